"""Ranks that disagree (tests/test_rank_check.py): each case runs on every rank, in one process group.

Every case returns ``{"error": (type name, message)}`` or ``{"loss": float}``; none may hang. The
cases run in order on every rank and each passes the same number of cross-rank checks on every rank
(their serials must stay aligned), except the last, where one rank skips the step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import spmd_expand as spmd
from spmd_expand.app.models import classification_step as _step
from spmd_expand import rank_check


def _mlp(width: int = 16, extra_layer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4)]
    if extra_layer:
        layers.append(nn.Linear(4, 4))
    return nn.Sequential(*layers)


def _step_with_rank_dependent_code(rank: int):
    def step(model, optimizer, x, y):
        out = model(x)
        if rank == 1:
            out = out @ torch.eye(4)  # only rank 1 runs this line
        loss = F.cross_entropy(out, y) * (1.0 + rank)  # a rank-dependent constant
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _scaled_step(scale: float | int):
    def step(model, optimizer, x, y):
        loss = F.cross_entropy(model(x), y) * scale  # a rank-dependent constant
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _compile_run(rank, mesh, plan, model, step) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    try:
        loss = spmd.compile(mesh=mesh, plan=plan, lower="eager")(step)(model, optimizer, x, y)
    except spmd.SpmdError as e:
        return {"error": (type(e).__name__, str(e))}
    return {"loss": float(loss)}


def _rank_dependent_pass(rank: int):
    """A local pass that issues one more all-reduce on rank 1 (a pass bug: ranks' collectives differ)."""

    def extra_all_reduce(gm):
        if rank != 1:
            return gm
        first = next(n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default)
        with gm.graph.inserting_after(first):
            again = gm.graph.call_function(first.target, first.args, first.kwargs)
            again.meta = dict(first.meta)
        with gm.graph.inserting_after(again):
            gm.graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (again,))
        gm.recompile()
        return gm

    return extra_all_reduce


def _pass_run(rank, mesh, plan) -> dict:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager", passes=["bucketing", _rank_dependent_pass(rank)])(_step)
    try:
        loss = step(model, optimizer, x, y)
    except spmd.SpmdError as e:
        return {"error": (type(e).__name__, str(e))}
    return {"loss": float(loss)}


def _backend_run(rank, mesh, plan) -> dict:
    class RankDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _mlp()

        def forward(self, x):
            out = self.mlp(x)
            return out * 2.0 if rank == 1 else out

    model = spmd.parallelize(RankDependent(), mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan, "lower": "eager"})
    try:
        out = compiled(torch.randn(4, 8))
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error
        inner = getattr(e, "inner_exception", e)
        return {"error": (type(inner).__name__, str(inner))}
    return {"loss": float(out.sum())}


def run_cases(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    ddp, fsdp = spmd.DDP(), spmd.FSDP()
    rank_check.timeout = 60.0  # a case that leaves a rank behind fails the test in a minute, not 30
    results = {
        "same": _compile_run(rank, mesh, fsdp, _mlp(), _step),
        "extra_layer": _compile_run(rank, mesh, ddp, _mlp(extra_layer=rank == 1), _step),
        "width": _compile_run(rank, mesh, fsdp, _mlp(width=24 if rank == 1 else 16), _step),
        "extra_matmul": _compile_run(rank, mesh, ddp, _mlp(), _step_with_rank_dependent_code(rank)),
        "scaled_loss": _compile_run(rank, mesh, ddp, _mlp(), _scaled_step(1.0 + rank)),
        "scaled_loss_int": _compile_run(rank, mesh, ddp, _mlp(), _scaled_step(1 + rank)),
        "backend": _backend_run(rank, mesh, ddp),
        "pass": _pass_run(rank, mesh, ddp),
    }
    # Last: rank 1 never reaches the step's checks; rank 0 must give up after the timeout.
    rank_check.timeout = 3.0
    if rank == 0:
        results["missing_rank"] = _compile_run(rank, mesh, ddp, _mlp(), _step)
    return results
