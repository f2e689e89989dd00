"""Collectives in the expanded local graph of DDP steps, as expansion emits them (``passes=[]``; the
passes are tested in test_passes.py) (fake 4-rank mesh; graphs only, no numerics).

DDP's contract: each gradient is all-reduced exactly once per step, where the optimizer reads it, no
matter how many micro-batches accumulate into it or how many optimizer ops read it; the batch is never
gathered; the returned loss is reduced to its single-device value.
"""

from __future__ import annotations

import collections
import operator

import pytest
import torch
import torch.fx as fx

import cases
import spmd_expand as spmd
from spmd_expand.app.models import MLP

C10D = torch.ops._c10d_functional
aten = torch.ops.aten
B_LOCAL = 4
PARAM_SHAPES = sorted([(32, 16), (32,), (4, 32), (4,)])  # MLP(16, 32, 4)


# ---------------------------------------------------------------- steps
ce_step = cases.cross_entropy_step
mse_step = cases.mse_step
ce_microbatch_step = cases.microbatch_step
mse_microbatch_step = cases.mse_microbatch_step


# ---------------------------------------------------------------- helpers
def compile_and_run(mesh, fn, make_optimizer, calls=1):
    torch.manual_seed(0)
    model = MLP()
    optimizer = make_optimizer(model.parameters())
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager", passes=[])(fn)
    x, y = torch.randn(B_LOCAL, 16), torch.randint(0, 4, (B_LOCAL,))
    graphs = []
    for _ in range(calls):
        step(model, optimizer, x, y)
        graphs.append(step.last.local_graph)
    return step, graphs


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def adamw_foreach(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)


def c10d_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(
        n.target._overloadpacket.__name__
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
    )


def all_reduces(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is C10D.all_reduce.default]


def reduced_shape(node: fx.Node) -> tuple:
    return tuple(int(s) for s in node.meta["val"].shape)


def gradient_reductions(gm: fx.GraphModule) -> list[fx.Node]:
    """All-reduces of parameter-shaped (non-scalar) tensors: DDP's gradient reductions."""
    return [n for n in all_reduces(gm) if reduced_shape(n) != ()]


def is_nll_total_weight(node: fx.Node) -> bool:
    """An all-reduce of nll_loss's total weight: its second output, or (mean reduction without class
    weights, ``trace._nll_loss_mean_as_sum``) the count of targets not ignored, taken from the targets."""
    src = node.args[0]
    if src.op == "call_function" and src.target is aten._to_copy.default:
        count = src.args[0]
        return count.target is aten.sum.default and count.args[0].target is aten.ne.Scalar
    return (
        src.op == "call_function"
        and src.target is operator.getitem
        and src.args[1] == 1
        and src.args[0].target in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
    )


def returned_reductions(gm: fx.GraphModule) -> list[fx.Node]:
    """All-reduces whose waited result is a graph output (the step's returned values)."""
    outputs = set(gm.graph.output_node().args[0])
    return [n for n in all_reduces(gm) if any(u.target is C10D.wait_tensor.default and u in outputs for u in n.users)]


def assert_every_collective_waited(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional" \
                and node.target is not C10D.wait_tensor.default:
            waits = [u for u in node.users if u.target is C10D.wait_tensor.default]
            assert len(waits) == 1, f"{node.format_node()} has no (single) wait_tensor user"


# ---------------------------------------------------------------- fixtures: compile each step once
@pytest.fixture(scope="module")
def ce_sgd(fake_mesh):
    return compile_and_run(fake_mesh, ce_step, sgd)[1][0]


@pytest.fixture(scope="module")
def mse_sgd(fake_mesh):
    return compile_and_run(fake_mesh, mse_step, sgd)[1][0]


# ---------------------------------------------------------------- single batch
def test_mse_sgd_ddp_counts(mse_sgd):
    counts = c10d_counts(mse_sgd)
    # 4 gradients + 1 returned loss; nothing else.
    assert counts["all_reduce"] == 5, counts
    assert counts["all_gather_into_tensor"] == 0, counts
    assert counts["reduce_scatter_tensor"] == 0, counts
    assert counts["wait_tensor"] == 5, counts
    assert sorted(reduced_shape(n) for n in gradient_reductions(mse_sgd)) == PARAM_SHAPES
    assert len(returned_reductions(mse_sgd)) == 1
    assert_every_collective_waited(mse_sgd)


def test_cross_entropy_sgd_ddp_counts(ce_sgd):
    counts = c10d_counts(ce_sgd)
    assert counts["all_gather_into_tensor"] == 0, counts
    assert counts["reduce_scatter_tensor"] == 0, counts
    assert counts["all_to_all_single"] == 0, counts
    grads = gradient_reductions(ce_sgd)
    assert sorted(reduced_shape(n) for n in grads) == PARAM_SHAPES  # each gradient exactly once
    returned = returned_reductions(ce_sgd)
    assert len(returned) == 1
    # The only other all-reduce allowed: nll_loss's total_weight, which DTensor's nll_loss_backward
    # rule needs replicated to divide by the global count (a scalar).
    others = [n for n in all_reduces(ce_sgd) if n not in grads and n not in returned]
    assert all(is_nll_total_weight(n) for n in others), [n.format_node() for n in others]
    assert len(others) <= 1
    assert counts["all_reduce"] == 4 + 1 + len(others), counts
    assert_every_collective_waited(ce_sgd)


def test_gradient_reductions_sum_and_feed_the_update(ce_sgd):
    for ar in gradient_reductions(ce_sgd):
        # all_reduce(tensor, reduce_op, group_name)
        assert ar.args[1] == "sum", ar.format_node()
        (wait,) = ar.users
        assert wait.target is C10D.wait_tensor.default
        # The reduced gradient is consumed by the SGD update (p + (-lr) * g).
        assert any(u.target is aten.add.Tensor for u in wait.users), [u.format_node() for u in wait.users]


# ---------------------------------------------------------------- micro-batches
def assert_only_batch_inputs_gathered(gm: fx.GraphModule) -> None:
    """Micro-batches of a sharded batch may re-lay out the *input* batch (an all-gather of the
    placeholder, so each micro-batch is evenly sharded), but nothing computed is ever gathered."""
    for n in gm.graph.nodes:
        if n.target is C10D.all_gather_into_tensor.default:
            assert n.args[0].op == "placeholder", f"an activation or gradient is all-gathered: {n.format_node()}"


@pytest.mark.parametrize("step_fn", [ce_microbatch_step, mse_microbatch_step])
def test_microbatch_reduces_each_gradient_once(fake_mesh, step_fn):
    _, (micro,) = compile_and_run(fake_mesh, step_fn, sgd)
    # One reduction per gradient per step, however many micro-batches accumulated into it.
    assert sorted(reduced_shape(n) for n in gradient_reductions(micro)) == PARAM_SHAPES, c10d_counts(micro)
    assert c10d_counts(micro)["reduce_scatter_tensor"] == 0
    assert_only_batch_inputs_gathered(micro)
    assert_every_collective_waited(micro)


def test_microbatch_compute_stays_data_parallel(fake_mesh):
    """Each rank runs the model on its 1/W share of every micro-batch, not on the global batch."""
    from torch.distributed.tensor import Shard

    _, (micro,) = compile_and_run(fake_mesh, mse_microbatch_step, sgd)
    matmuls = [n for n in micro.graph.nodes if n.target is aten.addmm.default]
    assert len(matmuls) == 4  # 2 layers x 2 micro-batches, forward
    for mm in matmuls:
        assert mm.meta["spmd"].output.placements == (Shard(0),), mm.meta["spmd"].output


# ---------------------------------------------------------------- AdamW foreach: many readers, one reduction
def test_adamw_foreach_reduces_each_gradient_once(fake_mesh):
    step, graphs = compile_and_run(fake_mesh, ce_step, adamw_foreach, calls=2)
    # AdamW's states are created before tracing: both calls run the one steady-state graph.
    assert sum(len(compiled) for compiled in step.cache.values()) == 1
    global_graph = step.last.traced.graph_module.graph
    markers = [n for n in global_graph.nodes if n.op == "call_function" and n.target is torch.ops.spmd_expand.gradient.default]
    assert len(markers) == 4
    # Precondition: AdamW reads each gradient in several foreach ops (lerp, addcmul twice).
    assert all(len(m.users) >= 2 for m in markers), [len(m.users) for m in markers]
    for gm in graphs:
        counts = c10d_counts(gm)
        assert sorted(reduced_shape(n) for n in gradient_reductions(gm)) == PARAM_SHAPES, counts
        assert counts["all_gather_into_tensor"] == 0 and counts["reduce_scatter_tensor"] == 0, counts
        assert len(returned_reductions(gm)) == 1
        assert counts["all_reduce"] <= 4 + 1 + 1, counts  # + nll total_weight at most
        assert_every_collective_waited(gm)


# ---------------------------------------------------------------- lockstep simulation of the W ranks
# The fake process group computes nothing, so the local graph is run here for all W ranks at once, node
# by node, with all_reduce evaluated across the ranks' values. For DDP the local graph does not depend on
# the rank (no offsets), so rank 0's graph serves every rank. This checks the semantic promise in-process.
def simulate(gm: fx.GraphModule, per_rank_inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    world = len(per_rank_inputs)
    envs: list[dict] = [{} for _ in range(world)]
    placeholders = iter(range(len(per_rank_inputs[0])))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            i = next(placeholders)
            for r in range(world):
                envs[r][node] = per_rank_inputs[r][i]
        elif node.op == "get_attr":
            for r in range(world):
                envs[r][node] = getattr(gm, node.target)
        elif node.op == "output":
            return [list(fx.node.map_arg(node.args[0], lambda n: env[n])) for env in envs]
        elif node.target is C10D.all_reduce.default:
            values = [env[node.args[0]] for env in envs]
            total = torch.stack(values).sum(0)
            op = node.args[1]
            assert op in ("sum", "avg"), node.format_node()
            reduced = total / world if op == "avg" else total
            for env in envs:
                env[node] = reduced.clone()
        elif node.target is C10D.wait_tensor.default:
            for env in envs:
                env[node] = env[node.args[0]]
        else:
            assert getattr(node.target, "namespace", None) != "_c10d_functional", node.format_node()
            for env in envs:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                env[node] = node.target(*args, **kwargs)
    raise AssertionError("graph without output")


def simulated_ddp_step(mesh, fn, x, y):
    """(reference loss, reference params, per-rank losses, per-rank params) after one SGD step."""
    world = mesh.size()
    torch.manual_seed(0)
    model = MLP()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    reference = MLP()
    reference.load_state_dict(initial)
    ref_loss = fn(reference, sgd(reference.parameters()), x, y).detach()

    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager", passes=[])(fn)
    n = x.shape[0] // world
    optimizer = sgd(model.parameters())
    step(model, optimizer, x[:n], y[:n])
    art = step.last
    inputs = []
    for r in range(world):
        shards = {"0": x[r * n:(r + 1) * n], "1": y[r * n:(r + 1) * n]}
        rank_inputs = []
        for role in art.traced.inputs:
            assert role.kind in ("param", "batch"), role
            rank_inputs.append(initial[role.fqn].clone() if role.kind == "param" else shards[role.key].clone())
        inputs.append(rank_inputs + [hp.read(optimizer) for hp in art.traced.hyperparameters])
    outputs = simulate(art.local_graph, inputs)
    params = [{role.fqn: t for role, t in zip(art.traced.inputs, rank_inputs) if role.kind == "param"} for rank_inputs in inputs]
    return ref_loss, dict(reference.named_parameters()), [o[0] for o in outputs], params


def check_ranks(mesh, x, y, fn=ce_step):
    ref_loss, ref_params, losses, params = simulated_ddp_step(mesh, fn, x, y)
    for r, (loss, ps) in enumerate(zip(losses, params)):
        for fqn, p in ps.items():
            torch.testing.assert_close(p, ref_params[fqn].detach(), rtol=1e-4, atol=1e-5, msg=f"rank {r} {fqn}")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} returned loss: {m}")


def test_simulated_ranks_match_single_device(fake_mesh):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    check_ranks(fake_mesh, x, y)
    check_ranks(fake_mesh, x, y, fn=mse_step)


def test_simulated_ranks_cross_entropy_with_ignored_targets(fake_mesh):
    """A mean over the global batch is not the average of per-rank means when ranks ignore different counts."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    y[:3] = -100  # ignore_index: 3 of rank 0's 4 targets, none of the others'
    check_ranks(fake_mesh, x, y)
