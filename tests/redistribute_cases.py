"""Spawned worker for tests/test_redistribute.py (module level, so each rank can import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore

from spmd_expand.expand import RedistributeCache

P, R, S0, S1 = Partial(), Replicate(), Shard(0), Shard(1)
# (mesh shape, source placements, target placements, global shape): uneven on at least one step.
CASES = [
    ((2, 2), (P, R), (S0, S0), (5, 3)),
    ((2, 2), (P, S0), (S0, S0), (5,)),
    ((2, 2), (P, R), (S0, S1), (3, 5)),
    ((2, 2), (S0, S0), (R, S0), (5, 3)),
    ((2, 2), (S0, S0), (R, R), (3, 2)),
    ((2, 2), (S0, S1), (S0, R), (4, 3)),
    ((2, 2), (P, P), (S0, R), (3, 4)),
    ((2, 2), (R, P), (S1, S0), (5, 3)),
    ((4,), (P,), (S0,), (7, 2)),
    ((4,), (S1,), (R,), (2, 6)),
    ((4,), (P,), (S0,), (2, 3)),  # fewer rows than ranks: two ranks hold empty pieces
]


def redistribute_like_dtensor(rank: int, world: int) -> list[dict]:
    """For each case: this rank's local result of the expansion's redistribution graph and of
    DTensor's own ``redistribute``, from the same local input (integers, so sums are exact)."""
    results = []
    for i, (mesh_shape, src, dst, shape) in enumerate(CASES):
        mesh = init_device_mesh("cpu", mesh_shape)
        full = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(i)).float()
        base = [R if p.is_partial() else p for p in src]
        local = distribute_tensor(full, mesh, base, src_data_rank=None).to_local()
        local = local + rank if any(p.is_partial() for p in src) else local  # partials differ per rank
        theirs = DTensor.from_local(local, mesh, src, run_check=False, shape=full.shape, stride=full.stride())
        theirs = theirs.redistribute(mesh, dst).to_local()
        meta = TensorMeta(full.shape, full.stride(), full.dtype)
        gm = RedistributeCache().get(DTensorSpec(mesh, src, tensor_meta=meta), DTensorSpec(mesh, dst, tensor_meta=meta))
        ours = gm(local)
        results.append({"case": f"{mesh_shape} {src} -> {dst} {shape}", "ours": ours, "theirs": theirs})
    return results


def graph_sizes_on_fake_world() -> dict:
    """Nodes of the redistribution graphs of 33 rows on 4x4 and 64x64 meshes of a fake world of 4096
    (run in a fresh process: the test session's default group is another)."""
    dist.init_process_group("fake", rank=0, world_size=4096, store=FakeStore())
    meta = TensorMeta(torch.Size((33, 8)), (8, 1), torch.float32)
    sizes = {}
    for side in (4, 64):
        mesh = DeviceMesh("cpu", torch.arange(side * side).view(side, side))
        for name, src, dst in [("P,R->S0,S0", (P, R), (S0, S0)), ("S0,S0->R,S0", (S0, S0), (R, S0))]:
            gm = RedistributeCache().get(DTensorSpec(mesh, src, tensor_meta=meta), DTensorSpec(mesh, dst, tensor_meta=meta))
            sizes[(side, name)] = len(gm.graph.nodes)
    dist.destroy_process_group()
    return sizes
