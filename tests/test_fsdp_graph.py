"""FSDP's expanded graph on the fake process group (W=4): which collectives, how many, on what (as
expansion and the regather pass emit them; bucketing and overlap are tested in test_passes.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import cases
import spmd_expand as spmd
from spmd_expand.app.models import MLP

C10D = torch.ops._c10d_functional
PARAMS = {"fc1.weight": (32, 16), "fc1.bias": (32,), "fc2.weight": (4, 32), "fc2.bias": (4,)}


def compiled(mesh, plan, step_fn=cases.cross_entropy_step, model=None):
    model = model or MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager", passes=["regather_for_backward"])(step_fn)
    for _ in range(2):  # the second call is the steady-state graph (optimizer state exists)
        step(model, optimizer, torch.randn(4, 16), torch.randint(0, 4, (4,)))
    return step, model, optimizer


def gathers_by_role(step) -> dict[str, list[tuple]]:
    """Global shapes of all-gathered values, by what they are: param, batch, or computed."""
    graph = step.last.local_graph.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    role = {p: r.kind for p, r in zip(placeholders, step.last.traced.inputs)}
    found: dict[str, list[tuple]] = {"param": [], "batch": [], "computed": []}
    for n in graph.nodes:
        if n.target is C10D.all_gather_into_tensor.default:
            src = n.args[0]
            while src.op == "call_function" and src.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                src = src.args[0]
            found[role.get(src, "computed")].append(tuple(n.meta["val"].shape))
    return {k: sorted(v) for k, v in found.items()}


def reduce_scattered(step) -> list[tuple]:
    # The input of a reduce_scatter is the full gradient (its output is this rank's shard).
    return sorted(
        tuple(n.args[0].meta["val"].shape) if "val" in n.args[0].meta else (n.meta["val"].shape[0] * n.args[2], *n.meta["val"].shape[1:])
        for n in step.last.local_graph.graph.nodes
        if n.target is C10D.reduce_scatter_tensor.default
    )


def test_reshard_after_forward_gathers_in_forward_and_again_in_backward(fake_mesh):
    step, _, _ = compiled(fake_mesh, spmd.FSDP(reshard_after_forward=True))
    # Forward reads every parameter once; backward needs only fc2.weight (the input grad of fc2).
    gathers = gathers_by_role(step)
    assert gathers["param"] == sorted(list(PARAMS.values()) + [(4, 32)])
    assert gathers["computed"] == [] and gathers["batch"] == []  # no activation or gradient gathered
    assert reduce_scattered(step) == sorted(PARAMS.values())


class Blocks(torch.nn.Module):
    """Root-block parameters (``embed``, ``head``) around a ``ModuleList`` of two blocks."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_default_keeps_the_root_block_gathered_for_backward(fake_mesh):
    """``reshard_after_forward=None`` (the default) is ``fully_shard``'s: blocks are re-gathered for
    backward, the root block (embeddings, head) is not: FSDP2 keeps its root module's parameters,
    which backward needs first."""
    plans = {"default": spmd.FSDP(), "all": spmd.FSDP(reshard_after_forward=True)}
    gathers = {k: gathers_by_role(compiled(fake_mesh, plan, model=Blocks())[0])["param"] for k, plan in plans.items()}
    once = sorted([(32, 16), (32,), (32, 32), (32,), (32, 32), (32,), (4, 32), (4,)])
    # Backward reads the blocks' weights and the head's weight (input gradients); not the embedding's.
    assert gathers["default"] == sorted(once + [(32, 32), (32, 32)])
    assert gathers["all"] == sorted(once + [(32, 32), (32, 32), (4, 32)])


def test_no_reshard_gathers_each_parameter_once(fake_mesh):
    step, _, _ = compiled(fake_mesh, spmd.FSDP(reshard_after_forward=False))
    assert gathers_by_role(step)["param"] == sorted(PARAMS.values())
    assert reduce_scattered(step) == sorted(PARAMS.values())


@pytest.mark.parametrize("reshard", [True, False])
def test_microbatches_reduce_scatter_once_per_step(fake_mesh, reshard):
    step, _, _ = compiled(fake_mesh, spmd.FSDP(reshard_after_forward=reshard), cases.microbatch_step)
    assert reduce_scattered(step) == sorted(PARAMS.values())
    gathers = gathers_by_role(step)
    # Per parameter: one gather per micro-batch forward with resharding (plus fc2.weight per backward),
    # one per step without; the batch inputs (x, y) are re-laid out once so micro-batches stay sharded.
    assert len(gathers["param"]) == (2 * 4 + 2 * 1 if reshard else 4)
    assert len(gathers["batch"]) == 2 and gathers["computed"] == []


def test_parameters_and_states_are_sharded_dtensors(fake_mesh):
    _, model, optimizer = compiled(fake_mesh, spmd.FSDP(), model=MLP(16, 33, 5))
    for fqn, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), fqn
        assert p.to_local().shape[0] == -(-p.shape[0] // 4) or p.to_local().shape[0] == p.shape[0] // 4
        state = optimizer.state[p]
        assert state["exp_avg"].placements == (Shard(0),) and state["exp_avg_sq"].placements == (Shard(0),)
        assert state["step"].placements == (Replicate(),)
        assert state["exp_avg"].to_local().shape == p.to_local().shape


def test_fsdp_ignored_module_stays_replicated(fake_mesh):
    model = MLP()
    _, model, _ = compiled(fake_mesh, spmd.FSDP(ignored_modules=[model.fc1]), model=model)
    assert model.fc1.weight.placements == (Replicate(),)
    assert model.fc2.weight.placements == (Shard(0),)
