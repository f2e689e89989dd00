"""Spawned worker for tests/test_distribute.py (module level, so each rank can import it)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import spmd_expand as spmd


def convert_uneven_noncontiguous(rank: int, world: int) -> dict:
    """Each rank builds a different Linear (its own seed) whose weight is non-contiguous and whose dims
    do not divide the world size; FSDP's conversion must give every rank its piece of rank 0's tensor."""
    torch.manual_seed(rank)
    lin = nn.Linear(5, 3)
    lin.weight = nn.Parameter(torch.randn(5, 3).t())  # (3, 5), stride (1, 3)
    original = {k: v.detach().clone() for k, v in lin.named_parameters()}
    step = spmd.compile(mesh=init_device_mesh("cpu", (world,)), plan=spmd.FSDP())(lambda m, x: m(x).sum())
    step.prepare(lin)
    return {
        "original": original,
        "local": {k: v.to_local().clone() for k, v in lin.named_parameters()},
        "full": {k: v.full_tensor() for k, v in lin.named_parameters()},
        "stride": lin.weight.stride(),
    }
