"""The conversion of parameters to DTensors (``state._distribute``): DTensor's pieces, rank 0's values."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spmd_expand.state import _distribute
from spmd_expand.app.launch import run_local

import distribute_cases

SHAPES = [(8, 4), (7, 3), (3, 5), (1, 2), (13,)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pieces_are_distribute_tensors(fake_mesh, shape):
    # Uneven and short dims, 1-D and 2-D meshes: the same local piece, global shape and stride as
    # DTensor's own distribute_tensor, for real and meta tensors.
    mesh_2d = init_device_mesh("cpu", (2, 2))
    cases = [(fake_mesh, (Shard(0),)), (mesh_2d, (Shard(0), Shard(0))), (mesh_2d, (Shard(0), Replicate())),
             (mesh_2d, (Replicate(), Shard(0)))]
    if len(shape) > 1:
        cases += [(mesh_2d, (Shard(0), Shard(1))), (fake_mesh, (Shard(1),))]
    for mesh, placements in cases:
        t = torch.randn(shape)
        ours = _distribute(t.clone(), mesh, placements)
        theirs = distribute_tensor(t.clone(), mesh, placements, src_data_rank=None)
        assert ours.placements == theirs.placements and ours.shape == theirs.shape
        assert ours.stride() == theirs.stride()
        torch.testing.assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0)
        meta = _distribute(torch.empty(shape, device="meta"), mesh, placements)
        assert meta.to_local().is_meta and meta.to_local().shape == theirs.to_local().shape


def test_sharded_values_come_from_rank_0():
    per_rank = run_local(distribute_cases.convert_uneven_noncontiguous, 2, timeout_s=300)
    for r in per_rank:
        for name, full in r["full"].items():
            torch.testing.assert_close(full, per_rank[0]["original"][name], rtol=0, atol=0)
        assert r["stride"] == (1, 3)  # the parameter's own stride, as distribute_tensor keeps it
    # weight (3, 5) on 2 ranks: rows 0-1 and 2; every rank's own values were different.
    assert [r["local"]["weight"].shape[0] for r in per_rank] == [2, 1]
    assert not torch.equal(per_rank[1]["original"]["weight"], per_rank[0]["original"]["weight"])
