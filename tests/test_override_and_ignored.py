"""module_override (swap an untraceable submodule while tracing, transform the expanded graph) and
DDP's ignored_modules (their gradients are not reduced). Graph checks on the fake process group."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import cases
import spmd_expand as spmd
from spmd_expand.app.models import MLP

C10D = torch.ops._c10d_functional


class Gated(nn.Module):
    """Branches on a tensor value: make_fx cannot trace this (data-dependent control flow)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h.relu() if h.sum() > 0 else h


class GatedStandIn(nn.Module):
    """The same computation without Python control flow; holds the original's Linear."""

    def __init__(self, original: Gated):
        super().__init__()
        self.fc = original.fc

    def forward(self, x):
        h = self.fc(x)
        return torch.where(h.sum() > 0, h.relu(), h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gated()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.gate(x))


class SwapGated(spmd.Override):
    def __init__(self):
        self.transformed: list[fx.GraphModule] = []

    def replacement(self, fqn, module):
        return GatedStandIn(module) if isinstance(module, Gated) else module

    def transform(self, gm):
        self.transformed.append(gm)
        return gm


step = cases.cross_entropy_step


def batch():
    return torch.randn(2, 16), torch.randint(0, 4, (2,))


def test_untraceable_submodule_fails_without_override(fake_mesh):
    model = Net()
    compiled = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(step)
    try:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch())
    except spmd.TraceError as e:
        assert "data-dependent" in str(e)
    else:
        raise AssertionError("tracing a data-dependent branch should fail")


def test_override_swaps_submodule_for_tracing_only(fake_mesh):
    model = Net()
    override = SwapGated()
    compiled = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager", module_override=[override])(step)
    compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch())
    assert isinstance(model.gate, Gated)  # the user's model is restored after tracing
    assert override.transformed == [compiled.last.local_graph]
    # The stand-in's parameters are the original's: all four gradients are reduced, under their FQNs.
    markers = [
        n.args[1]
        for n in compiled.last.traced.graph_module.graph.nodes
        if n.target is torch.ops.spmd_expand.gradient.default
    ]
    assert sorted(markers) == ["gate.fc.bias", "gate.fc.weight", "head.bias", "head.weight"]


def test_ddp_ignored_modules_are_not_reduced(fake_mesh):
    model = MLP()
    compiled = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(ignored_modules=[model.fc1]), lower="eager")(step)
    compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randint(0, 4, (2,)))
    reduced = sorted(
        tuple(n.meta["val"].shape)
        for n in compiled.last.expanded.graph.nodes
        if n.target is C10D.all_reduce.default and n.meta["val"].dim() > 0
    )
    # Only fc2's weight (4, 32) and bias (4,) are all-reduced (before bucketing); fc1's gradients stay
    # rank-local.
    assert reduced == [(4,), (4, 32)]
