"""spmd_expand.functionalize: mutation removed in one walk over graph 1, checked against torch.

Two kinds of checks. On small functions traced with ``make_fx``: the functional graph computes the
same outputs and leaves the same values in its inputs as the graph with mutation (run on real
tensors), and the walk refuses (returns None) where only torch's functionalization is exact. On
whole train steps (``spmd.compile`` on the fake process group): the walk is used, and its graph has
the same nodes as torch's functionalization of the same graph 1 (``torch.func.functionalize`` under
``make_fx``, the path it replaces), compared as a multiset of structural node hashes.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import spmd_expand as spmd
import spmd_expand.trace as trace_module
from spmd_expand.functionalize import functional_twin, functionalize_graph, list_functional_twin

from loops import classification_step

aten = torch.ops.aten


def _graph(fn, *inputs):
    return make_fx(fn, tracing_mode="symbolic")(*inputs)


def _by_torch(graph_1: fx.GraphModule, *inputs) -> fx.GraphModule:
    def replay(*flat):
        return fx.Interpreter(graph_1).run(*flat)

    return make_fx(torch.func.functionalize(replay, remove="mutations"), tracing_mode="symbolic")(*inputs)


def _runs_alike(graph_1: fx.GraphModule, functional: fx.GraphModule, *inputs) -> None:
    """Same outputs, and the same values left in the inputs, on real tensors."""
    with_mutation = [t.clone() for t in inputs]
    without = [t.clone() for t in inputs]
    expected = graph_1(*with_mutation)
    got = functional(*without)
    torch.testing.assert_close(got, expected)
    for a, b in zip(without, with_mutation):
        torch.testing.assert_close(a, b)


def _writes(gm: fx.GraphModule) -> list[str]:
    """In-place ops left in ``gm`` other than the final copies into placeholders."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            written = [a for a in n.target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            if written and not (n.target is aten.copy_.default and n.args[0].op == "placeholder"):
                out.append(str(n.target))
    return out


def _structure(gm: fx.GraphModule) -> collections.Counter:
    """Multiset of node hashes over (target, arguments), placeholders by position; whole-tensor
    aliases (detach) are looked through and dead nodes dropped."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    gm.graph.eliminate_dead_code()
    key: dict[fx.Node, object] = {}

    def k(a):
        if isinstance(a, fx.Node):
            return key[a]
        if isinstance(a, (list, tuple)):
            return tuple(k(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((n, k(v)) for n, v in a.items()))
        return repr(a)

    counts: collections.Counter = collections.Counter()
    placeholders = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            key[n] = ("placeholder", placeholders)
            placeholders += 1
        elif n.op == "call_function" and getattr(n.target, "namespace", None) == "profiler":
            key[n] = None
        elif n.target in (aten.detach.default, aten.alias.default):
            key[n] = key[n.args[0]]
        else:
            key[n] = hash((n.op, str(n.target), k(n.args), k(n.kwargs)))
            counts[key[n]] += 1
    return counts


def test_in_place_updates_of_inputs_become_functional_ops_and_final_copies():
    def step(p, g, m):
        m.mul_(0.9).add_(g)  # an in-place result written again
        p.detach().sub_(m, alpha=0.1)  # a write through detach writes p
        return (p * 2).sum(), m + 1

    inputs = (torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3))
    graph_1 = _graph(step, *inputs)
    functional = functionalize_graph(graph_1, {})
    assert functional is not None
    assert _writes(functional) == []
    copies = [n.args[0].target for n in functional.graph.nodes if n.target is aten.copy_.default]
    assert copies == [graph_1.graph.find_nodes(op="placeholder")[i].target for i in (0, 2)]
    _runs_alike(graph_1, functional, *inputs)
    assert _structure(functional) == _structure(_by_torch(graph_1, *inputs))


def test_foreach_and_batch_norm_writes():
    def step(a, b, c, x, running_mean, running_var):
        torch._foreach_mul_([a, b], 0.5)
        torch._foreach_add_([a, b], [c, c])
        y = F.batch_norm(x, running_mean, running_var, training=True, momentum=0.1)
        return a + b, y

    inputs = (torch.randn(3), torch.randn(3), torch.randn(3), torch.randn(8, 3), torch.zeros(3), torch.ones(3))
    graph_1 = _graph(step, *inputs)
    functional = functionalize_graph(graph_1, {})
    assert functional is not None
    assert _writes(functional) == []
    _runs_alike(graph_1, functional, *inputs)
    assert _structure(functional) == _structure(_by_torch(graph_1, *inputs))


def test_a_view_read_before_its_base_is_written_is_kept():
    def step(p, x):
        y = x @ p.t()
        p.add_(1.0)
        return y, p * 3

    inputs = (torch.randn(3, 4), torch.randn(2, 4))
    graph_1 = _graph(step, *inputs)
    functional = functionalize_graph(graph_1, {})
    assert functional is not None
    _runs_alike(graph_1, functional, *inputs)


@pytest.mark.parametrize(
    "step",
    [
        lambda p: (p[0].fill_(1.0), p.sum())[1],  # a write through a view
        lambda p: (p.t(), p.add_(1.0))[0] * 2,  # a view read after its base was written
    ],
    ids=["write_through_a_view", "view_read_after_the_write"],
)
def test_mutations_that_need_view_replay_are_left_to_torch(step):
    graph_1 = _graph(step, torch.randn(3, 3))
    assert functionalize_graph(graph_1, {}) is None


def test_decompositions_apply_to_functional_twins():
    def add_as_sub(a, b, alpha=1):
        if alpha != 1:
            return NotImplemented
        return aten.sub.Tensor(a, aten.neg.default(b))

    def step(p, g):
        p.add_(g)
        p.add_(g, alpha=2.0)  # the decomposition declines: stays add
        return p.sum()

    inputs = (torch.randn(5), torch.randn(5))
    graph_1 = _graph(step, *inputs)
    functional = functionalize_graph(graph_1, {aten.add.Tensor: add_as_sub})
    targets = [n.target for n in functional.graph.nodes]
    assert targets.count(aten.add.Tensor) == 1 and aten.neg.default in targets and aten.sub.Tensor in targets
    _runs_alike(graph_1, functional, *inputs)


def test_functional_twins():
    assert functional_twin(aten.add_.Tensor) is aten.add.Tensor
    assert functional_twin(aten.copy_.default) is aten.copy.default
    assert functional_twin(aten._foreach_mul_.Scalar) is aten._foreach_mul.Scalar
    for op in (aten.t_.default, aten.resize_.default, aten.uniform_.default, aten.add.Tensor):
        assert functional_twin(op) is None, op
    # Ops that write several tensor lists: the fused optimizer kernels.
    assert list_functional_twin(aten._fused_adamw_.default) is aten._fused_adamw.default
    assert list_functional_twin(aten._fused_sgd_.tensor_lr) is aten._fused_sgd.tensor_lr
    assert list_functional_twin(aten._fused_adagrad_.default) is aten._fused_adagrad.default
    for op in (aten._foreach_copy_.default, aten._foreach_zero_.default, aten.add_.Tensor, aten._amp_foreach_non_finite_check_and_unscale_.default):
        assert list_functional_twin(op) is None, op


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(F.relu_(self.bn(self.conv(x))).mean((2, 3)))


_CASES = {
    "mlp_adam": (lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), lambda p: torch.optim.Adam(p, lr=0.1), (8, 8)),
    "mlp_sgd_momentum": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        (8, 8),
    ),
    "mlp_adamw_foreach": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)),
        lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
        (8, 8),
    ),
    "conv_batch_norm_sgd": (_ConvBN, lambda p: torch.optim.SGD(p, lr=0.1), (8, 3, 6, 6)),
}
# Fused optimizers: one op writes several tensor lists (aten._fused_adamw_, ...).
_FUSED = {
    "mlp_adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "mlp_adam_amsgrad_fused": lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True, fused=True),
    "mlp_sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
    "mlp_adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
}
_CASES.update(
    (name, (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), optimizer, (8, 8)))
    for name, optimizer in _FUSED.items()
)


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_train_steps_take_the_walk_and_match_torchs_functionalization(case, plan, fake_mesh, monkeypatch):
    build, make_optimizer, x_shape = _CASES[case]
    seen = []

    def recording(graph_1, decompositions, skip):
        functional = functionalize_graph(graph_1, decompositions, skip)
        assert functional is not None
        # Compared here: the later stages (the global passes) rewrite the graph in place.
        placeholders = [n.meta["val"] for n in graph_1.graph.find_nodes(op="placeholder")]
        fakes = [v for v in placeholders if isinstance(v, torch.Tensor)]
        sym_values = [v for v in placeholders if not isinstance(v, torch.Tensor)]  # hyperparameters, last
        reference = trace_module._functionalize_by_tracing(graph_1, fakes, sym_values)
        seen.append((_structure(functional), _structure(reference)))
        return functional

    monkeypatch.setattr(trace_module, "functionalize_graph", recording)
    torch.manual_seed(0)
    model = build()
    optimizer = make_optimizer(model.parameters())
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP() if plan == "ddp" else spmd.FSDP(), lower="eager")(classification_step)
    x, y = torch.randn(x_shape), torch.randint(0, 4, (8,))
    step(model, optimizer, x, y)
    step(model, optimizer, x, y)  # SGD's momentum buffers exist now: another graph
    assert len(seen) == (2 if case == "mlp_sgd_momentum" else 1)
    for walked, traced in seen:
        assert walked == traced


def test_an_in_place_result_keeps_the_dtype_of_the_tensor_it_writes():
    def step(p, g):
        p.add_(g)  # float32 += float64 stays float32; the functional add would be float64
        return p * 3

    inputs = (torch.randn(4), torch.randn(4, dtype=torch.float64))
    graph_1 = _graph(step, *inputs)
    functional = functionalize_graph(graph_1, {})
    (output,) = pytree.tree_leaves(functional.graph.find_nodes(op="output")[0].args)
    assert output.meta["val"].dtype == torch.float32
    _runs_alike(graph_1, functional, *inputs)
    assert _structure(functional) == _structure(_by_torch(graph_1, *inputs))
