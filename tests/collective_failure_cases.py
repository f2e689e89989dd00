"""Ranks whose collectives fail while the compiled step runs (tests/test_collective_failure.py).

Each worker returns ``{"error": (type name, message)}`` or ``{"ok": ...}`` per rank; none may hang.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import spmd_expand as spmd
from spmd_expand.prologue import PrologueRunner

TIMEOUT_S = 3.0


# The step lives here, not in spmd_expand.app.models: the error must name a user's source line, and
# user_source_line skips frames inside spmd_expand.
def _step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _setup(world_size: int, lower: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower=lower, timeout=TIMEOUT_S)(_step)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step(model, optimizer, x, y)  # compiled, run once on every rank
    return step, model, optimizer, x, y


def _error(e: BaseException) -> dict:
    return {"error": (type(e).__name__, str(e))}


def _outcome(step, model, optimizer, x, y) -> dict:
    """``{"ok": True}`` when the call returns, else its error (:func:`_error`)."""
    try:
        step(model, optimizer, x, y)
        return {"ok": True}
    except Exception as e:  # noqa: BLE001 - the result is the error
        return _error(e)


def stalled_rank(rank: int, world_size: int, lower: str = "eager") -> dict:
    """Rank 1 passes the batch check, then computes for longer than the timeout before its collectives."""
    step, model, optimizer, x, y = _setup(world_size, lower)
    if rank == 1:
        def stalled(*inputs):
            time.sleep(3 * TIMEOUT_S)
            raise RuntimeError("rank 1 stalled")
        # The DDP step runs its forward under the check (spmd_expand/prologue.py): what stalls is the rest.
        assert isinstance(step.last.runner, PrologueRunner)
        step.last.runner.rest = stalled
    return _outcome(step, model, optimizer, x, y)


def stopped_rank(rank: int, world_size: int) -> dict:
    """Rank 1 stops calling the step: rank 0's batch check before its next step times out."""
    step, model, optimizer, x, y = _setup(world_size, "eager")
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)
        return {"ok": "stopped"}
    return _outcome(step, model, optimizer, x, y)


def absent_rank(rank: int, world_size: int) -> dict:
    """Rank 1 never calls the step: rank 0's cross-rank check of the model waits ``timeout``, not the
    store's 300 s."""
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)
        return {"ok": "absent"}
    try:
        _setup(world_size, "eager")
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        return _error(e)


def failing_prologue(rank: int, world_size: int) -> dict:
    """Rank 1's forward fails on a call where its learning rate differs from rank 0's: rank 1 still
    takes part in the check's verdict before its error leaves the step (spmd_expand/api.py's
    ``_run_checked``), so rank 0, which needs rank 1's report, does not wait; both learn the difference."""
    step, model, optimizer, x, y = _setup(world_size, "eager")
    if rank == 1:
        optimizer.param_groups[0]["lr"] = 0.05

        def failing(*inputs):
            raise RuntimeError("rank 1's forward failed")

        assert isinstance(step.last.runner, PrologueRunner)
        step.last.runner.prologue = failing
    return _outcome(step, model, optimizer, x, y)
