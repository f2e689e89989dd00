"""The prologue split (spmd_expand/prologue.py): what runs while the per-call rank check is in flight.

Single process. The multi-rank behaviour (the check's verdict between the prologue and the rest, a
fast-path rank meeting a full-path one) is in tests/loops.py's refused-batch cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import spmd_expand as spmd
from spmd_expand.app.models import classification_step
from spmd_expand.graph_stats import COLLECTIVES
from spmd_expand.passes.feeders import WAIT
from spmd_expand.prologue import PrologueRunner, _wrapped, split_prologue


def _step_with_a_write(w, x, buf):
    wt = w.t()
    h = torch.relu(x @ wt)
    d = h * torch.bernoulli(torch.full_like(h, 0.5))  # a draw (functional, as in the step's graphs)
    buf.copy_(buf * 0.9 + h.mean())  # the first write: nothing after it joins the prologue
    r = torch.rand_like(h)  # a draw after the write
    g = d * r + buf  # reads the written buffer
    return g.sum() + (wt * 2).sum()  # reads a view of an input made before the write


def _inputs():
    torch.manual_seed(0)
    return torch.randn(6, 4), torch.randn(3, 4), torch.randn(6)


def test_split_keeps_values_writes_and_draws():
    gm = make_fx(_step_with_a_write)(*_inputs())
    split = split_prologue(gm)
    assert split is not None
    prologue_ops = [n.target for n in split.prologue.graph.nodes if n.op == "call_function"]
    rest_ops = [n.target for n in split.rest.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.default in prologue_ops
    assert torch.ops.aten.bernoulli.default in prologue_ops
    assert torch.ops.aten.rand_like.default not in prologue_ops and torch.ops.aten.rand_like.default in rest_ops
    assert not any(t._schema.is_mutable for t in prologue_ops if isinstance(t, torch._ops.OpOverload))
    # The transpose of w is made again in the rest, not passed across (it would alias w).
    carried = [n for n in split.rest.graph.nodes if n.op == "placeholder" and n.name.startswith("prologue_")]
    assert len(carried) == split.carried and all("t" != n.name.removeprefix("prologue_") for n in carried)
    assert torch.ops.aten.t.default in rest_ops

    w, x, buf = _inputs()
    torch.manual_seed(1)
    expected = gm(w, x, buf)
    expected_buf = buf.clone()
    w, x, buf = _inputs()
    order = []

    def prologue(*args):
        order.append("prologue")
        return split.prologue(*args)

    def lower_rest(examples):
        assert len(examples) == 3 + split.carried
        return lambda *args: (order.append("rest"), split.rest(*args))[1]

    def start(count):
        assert count is None  # no folded all-reduce in this graph
        order.append("check issued")
        return lambda: order.append("verdict")

    runner = PrologueRunner(prologue, lower_rest)
    torch.manual_seed(1)
    got = runner.run([w, x, buf], start)
    assert order == ["check issued", "prologue", "verdict", "rest"]
    assert torch.equal(got, expected) and torch.equal(buf, expected_buf)
    order.clear()
    runner(w, x, buf)  # without a check: both parts back to back
    assert order == ["prologue", "rest"]


def test_a_prologue_result_sharing_an_inputs_storage_is_copied():
    # Inductor may return an input itself for a no-op copy; the rest writes that input in place.
    def rest(x, carried):
        x.add_(1)
        return [carried + 0]

    runner = PrologueRunner(lambda x: [x], lambda examples: rest)
    x = torch.zeros(3)
    assert torch.equal(runner(x)[0], torch.zeros(3))
    assert torch.equal(runner(x)[0], torch.ones(3))  # later calls copy it too
    assert runner._copied == [0]
    # Results that share storage with each other (views of one buffer, as Inductor returns a split's
    # parts) are only read by the rest: not copied (a copy per call measured 73 of the GPT's 181).
    shared = PrologueRunner(lambda x: list((x * 2).split(1)), lambda examples: lambda x, *parts: list(parts))
    shared(torch.zeros(3))
    assert shared._copied == []


def _compiled_mlp(mesh, plan):
    """An MLP classification step compiled for ``plan`` and called twice (its steady-state graph)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(classification_step)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    step(model, optimizer, x, y)
    step(model, optimizer, x, y)
    return step


def test_ddp_step_prologue_is_the_forward(fake_mesh):
    step = _compiled_mlp(fake_mesh, spmd.DDP())
    gm = step.last.local_graph
    split = split_prologue(gm)
    assert split is not None
    prologue = [n for n in split.prologue.graph.nodes if n.op == "call_function"]
    assert not any(n.target in COLLECTIVES or n.target is WAIT for n in prologue)
    assert not any(n.target._schema.is_mutable for n in prologue if isinstance(n.target, torch._ops.OpOverload))
    # Both forward matmuls; every collective of the graph is in the rest.
    assert sum(n.target is torch.ops.aten.addmm.default for n in prologue) == 2
    count = lambda g: sum(n.op == "call_function" and n.target in COLLECTIVES for n in g.nodes)  # noqa: E731
    assert count(split.rest.graph) == count(gm.graph) > 0
    # On torch's fake process group no check is exchanged: the step's runner is not split.
    assert not isinstance(step.last.runner, PrologueRunner)
    # The loss denominator's all-reduce travels in the check when it spans the check's ranks.
    assert split.count is None
    folded = split_prologue(gm, frozenset(range(4)))
    assert folded.count is not None and folded.count_node
    assert count(folded.rest.graph) == count(gm.graph) - 1
    targets = torch.tensor([1, -100, 2, -100, 0, 3, 1, 2])
    roles = step.last.traced.inputs  # one per placeholder, then the hyperparameters
    inputs = [
        targets if i < len(roles) and roles[i].kind == "batch" and str(roles[i].key) == "1" else None
        for i, _ in enumerate(gm.graph.find_nodes(op="placeholder"))
    ]
    assert folded.count(*inputs)[0].item() == 6  # this rank's targets not ignored
    # Not over other ranks than the check's (a 2-D mesh's data-parallel dim).
    assert split_prologue(gm, frozenset(range(8))).count is None


def test_fsdp_step_has_no_prologue_worth_splitting(fake_mesh):
    step = _compiled_mlp(fake_mesh, spmd.FSDP())
    # The first all-gather comes before any matrix product: nothing to run under the check.
    assert split_prologue(step.last.local_graph) is None


def test_the_check_sums_the_counts_only_when_every_rank_sent_one(fake_mesh):
    from spmd_expand.guards import _verdict, mesh_group

    group = mesh_group(fake_mesh)

    def verdict(flags, counts):
        rows = torch.tensor([[7, 2, 0, 9, 0, f, c] for f, c in zip(flags, counts)])
        return _verdict(rows.flatten(), group, [], None, fake_mesh, None, [], [], (), (), ())

    assert verdict([1, 1, 1, 1], [3, 0, 5, 1]) == 9
    with pytest.raises(spmd.SpmdError, match="only some send a count"):
        verdict([1, 0, 1, 1], [3, 0, 5, 1])


def test_a_folded_count_wraps_as_its_dtype_does():
    """The ranks' counts summed in the check row are Python ints; written back into the count's dtype
    they wrap as an all-reduce in that dtype does (an int8 count of 128 rows on each of 2 ranks: 0,
    as one device's 256). new_full refused the unwrapped -256 with a raw RuntimeError."""
    assert _wrapped(-256, torch.int8) == 0 and _wrapped(-128, torch.int8) == -128 and _wrapped(128, torch.int8) == -128
    assert _wrapped(300, torch.uint8) == 44 and _wrapped(-1, torch.uint8) == 255
    assert _wrapped(2**40, torch.int64) == 2**40 and _wrapped(2**63, torch.int64) == -(2**63)
