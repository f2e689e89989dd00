"""Which graphs Inductor compiles: a graph that runs once (it creates optimizer state the next call
passes in) is lowered eagerly; the steady-state graph goes to Inductor."""

from __future__ import annotations

import torch
import torch.nn as nn

import spmd_expand as spmd
from spmd_expand.app.models import classification_step


def test_graph_that_creates_momentum_buffers_is_not_sent_to_inductor(fake_mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="inductor")(classification_step)
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    step(model, optimizer, x, y)  # SGD creates momentum_buffer in its first step
    assert step.last.lowering == "eager"
    assert any(o.kind == "state" for o in step.last.traced.outputs)
    first = step.last
    step(model, optimizer, x, y)  # momentum buffers are inputs now: the steady-state graph
    assert step.last is not first and step.last.lowering == "inductor"
    step(model, optimizer, x, y)
    assert sum(len(v) for v in step.cache.values()) == 2
