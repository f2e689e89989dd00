"""Workers for tests/test_lowering.py's multi-rank cases (spawned processes import them from here)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import spmd_expand as spmd


def batch_weighted_step(model, optimizer, x):
    """A loss of terms over the whole batch (factory tensors sized by it, the rows' Gram matrix): its
    backward all-gathers several values. From the hunt on cross-sample losses, where Inductor's code
    for the graph after the prologue read one all-gather's output before its wait (torch 2.13, CPU)."""
    o = model(x)
    n = x.shape[0]
    loss = (
        (o[1:, 0] * torch.ones(n - 1).cumsum(0)).sum()
        + (o[: n // 2, 1] * torch.arange(n // 2)).sum()
        + (torch.cat([o[:, 0], o[:1, 0]]) * torch.arange(n + 1)).sum()
        + (torch.zeros(n, n) + o @ o.T).triu().sum()
        + (o[:, 0] * torch.full((n,), 1.0 / n)).sum()
        + (o[:, 1] * torch.linspace(0, 1, n)).sum()
        + (torch.cat([o[:, 2], o[:, 3]]) * torch.arange(2 * n)).sum()
        + (o[:, 0] * torch.arange(n, 0, -1)).sum()
        + (o[::2, 0] * torch.arange(0, n, 2)).sum()
        + (o[:, 0] * torch.arange(1, n + 1)).sum()
        + (o @ o.T)[torch.tril_indices(n, n, -1)[0], torch.tril_indices(n, n, -1)[1]].pow(2).sum()
        + ((o @ o.T) * (1 - torch.eye(n))).sum()
    ) * 1e-3
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def run_batch_weighted_inductor(rank: int, world: int) -> dict:
    """Worker: :func:`batch_weighted_step` under DDP lowered by Inductor, and on one device over the
    global batch; losses, parameters, and the warnings of the compiled calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = spmd.compile(mesh=init_device_mesh("cpu", (world,)), plan=spmd.DDP(), lower="inductor")(batch_weighted_step)
    losses, ref_losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 + i))
            rows = x.shape[0] // world
            losses.append(step(model, optimizer, x[rank * rows:(rank + 1) * rows]).detach())
            ref_losses.append(batch_weighted_step(reference, ref_optimizer, x).detach())
    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
    return {
        "losses": losses, "ref_losses": ref_losses, "params": params,
        "ref_params": [p.detach() for p in reference.parameters()],
        "warnings": [str(w.message) for w in caught],
    }
