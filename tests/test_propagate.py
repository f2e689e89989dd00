"""Propagation on small DDP steps traced over a fake 4-rank mesh: placements in ``node.meta["spmd"]``.

Only graphs and annotations are inspected (the fake process group computes nothing meaningful).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import cases
import spmd_expand as spmd
from spmd_expand.app.models import MLP
from spmd_expand.spec import NodeSharding

W = 4
B_LOCAL = 2
GRADIENT = torch.ops.spmd_expand.gradient.default
aten = torch.ops.aten


ce_step = cases.cross_entropy_step


def flatten_step(model, optimizer, x, y):
    """Reads the batch size from the batch: a sym_size node in the global graph."""
    loss = F.cross_entropy(model(x.view(x.shape[0], -1)), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def compile_and_run(mesh, fn, x, y):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(fn)
    step(model, optimizer, x, y)
    return step.last


@pytest.fixture(scope="module")
def mlp(fake_mesh):
    return compile_and_run(fake_mesh, ce_step, torch.randn(B_LOCAL, 16), torch.randint(0, 4, (B_LOCAL,)))


@pytest.fixture(scope="module")
def flat(fake_mesh):
    return compile_and_run(fake_mesh, flatten_step, torch.randn(B_LOCAL, 4, 4), torch.randint(0, 4, (B_LOCAL,)))


def placeholders(traced):
    nodes = [n for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    # Tensor inputs, then one float input per optimizer hyperparameter (SGD: lr).
    assert len(nodes) == len(traced.inputs) + len(traced.hyperparameters)
    return list(zip(traced.inputs, nodes))


def test_batch_placeholders_are_shard0(mlp):
    batch = [(r, n) for r, n in placeholders(mlp.traced) if r.kind == "batch"]
    assert len(batch) == 2
    for _, node in batch:
        out = node.meta["spmd"].output
        assert isinstance(out, DTensorSpec)
        assert out.placements == (Shard(0),)
        # Global shapes: the local batch times the mesh size.
        assert out.tensor_meta.shape[0] == W * B_LOCAL


def test_parameter_placeholders_are_replicate(mlp):
    params = [(r, n) for r, n in placeholders(mlp.traced) if r.kind == "param"]
    assert sorted(r.fqn for r, _ in params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for _, node in params:
        assert node.meta["spmd"].output.placements == (Replicate(),)


def test_gradient_markers_reduce_partial_gradients_to_replicate(mlp):
    markers = [n for n in mlp.traced.graph_module.graph.nodes if n.op == "call_function" and n.target is GRADIENT]
    assert sorted(n.args[1] for n in markers) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for node in markers:
        sharding = node.meta["spmd"]
        assert sharding.output.placements == (Replicate(),), node.name
        # The marker asks for its input as Replicate: that redistribution is the gradient reduction.
        assert sharding.inputs[0].placements == (Replicate(),), node.name
        produced = node.args[0].meta["spmd"].output
        assert len(produced.placements) == 1 and isinstance(produced.placements[0], Partial), (
            f"{node.name}: the traced gradient {node.args[0].name} should be Partial (a per-rank sum), "
            f"got {produced.placements}"
        )


def test_returned_loss_is_replicated_at_the_output(mlp):
    out = mlp.traced.graph_module.graph.output_node()
    roles = [r.kind for r in mlp.traced.outputs]
    assert roles == ["return"]
    (wanted,) = out.meta["spmd"].inputs
    assert wanted.placements == (Replicate(),)
    # ... while the loss itself comes out of the forward as a partial (rank-local mean).
    (loss,) = out.args[0]
    assert isinstance(loss.meta["spmd"].output.placements[0], Partial)


def test_every_node_is_annotated(mlp, flat):
    for art in (mlp, flat):
        for node in art.traced.graph_module.graph.nodes:
            assert isinstance(node.meta.get("spmd"), NodeSharding), f"{node.op} {node.name} has no spmd annotation"


def test_sym_size_of_batch_is_sharded_dsymint(flat):
    graph = flat.traced.graph_module.graph
    sizes = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.sym_size.int]
    assert sizes, "x.shape[0] of a symbolic batch should be a sym_size node"
    batch_x = next(n for r, n in placeholders(flat.traced) if r.kind == "batch" and n.meta["val"].dim() == 3)
    of_batch = [n for n in sizes if n.args[0] is batch_x and n.args[1] == 0]
    assert len(of_batch) == 1
    d = of_batch[0].meta["spmd"].output
    assert isinstance(d, spmd.DSymInt)
    assert d.global_value == W * d.local_value
    assert d.local_value == B_LOCAL
    assert d.mesh_dims == (0,)


def test_view_with_batch_size_keeps_batch_sharded(flat):
    graph = flat.traced.graph_module.graph
    views = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.view.default
             and isinstance(n.args[1][0], torch.fx.Node) and n.args[1][0].target is aten.sym_size.int]
    assert len(views) == 1
    assert views[0].meta["spmd"].output.placements == (Shard(0),)
    assert views[0].meta["spmd"].output.tensor_meta.shape == torch.Size([W * B_LOCAL, 16])


def test_view_sizes_are_local_in_expanded_graph(flat):
    # The same view in the local graph takes rank 0's local batch size, not the global one.
    views = [n for n in flat.expanded.graph.nodes if n.op == "call_function" and n.target is aten.view.default
             and len(n.args[1]) == 2 and n.args[1][1] == 16]
    assert [list(n.args[1]) for n in views] == [[B_LOCAL, 16]]

