"""The expansion's redistributions (``expand.RedistributeCache``): DTensor's values, constant size in W."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore

from spmd_expand.app.launch import run_local
from spmd_expand.expand import RedistributeCache

import redistribute_cases


def test_uneven_redistributions_equal_dtensors_on_4_ranks():
    # Uneven shards with one or two mesh dims changing at once (FSDP+TP gradients and parameters):
    # every rank's local result equals DTensor's redistribute of the same local input.
    per_rank = run_local(redistribute_cases.redistribute_like_dtensor, 4, timeout_s=300)
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["ours"].shape == r["theirs"].shape, (rank, r["case"])
            torch.testing.assert_close(r["ours"], r["theirs"], rtol=0, atol=0, msg=f"rank {rank}: {r['case']}")


def test_two_mesh_dims_changing_stay_constant_size_in_w():
    # Partial(sum), Replicate -> Shard(0), Shard(0) on 33 rows: uneven at 4x4 and at 64x64. DTensor
    # pads each of the W pieces (O(W) nodes); the expansion's graph keeps its size.
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", rank=0, world_size=4096, store=FakeStore())
    try:
        meta = TensorMeta(torch.Size((33, 8)), (8, 1), torch.float32)
        sizes = {}
        for side in (4, 64):
            mesh = DeviceMesh("cpu", torch.arange(side * side).view(side, side))
            for src, dst in [((Partial(), Replicate()), (Shard(0), Shard(0))), ((Shard(0), Shard(0)), (Replicate(), Shard(0)))]:
                gm = RedistributeCache().get(DTensorSpec(mesh, src, tensor_meta=meta), DTensorSpec(mesh, dst, tensor_meta=meta))
                sizes[(side, src)] = len(gm.graph.nodes)
        for src in [(Partial(), Replicate()), (Shard(0), Shard(0))]:
            assert sizes[(64, src)] <= sizes[(4, src)] + 4, sizes
    finally:
        if owned:
            dist.destroy_process_group()
