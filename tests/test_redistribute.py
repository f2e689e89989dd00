"""The expansion's redistributions (``expand.RedistributeCache``): DTensor's values, constant size in W."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch

from spmd_expand.app.launch import run_local

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
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        sizes = pool.submit(redistribute_cases.graph_sizes_on_fake_world).result(timeout=300)
    for name in ("P,R->S0,S0", "S0,S0->R,S0"):
        assert sizes[(64, name)] <= sizes[(4, name)] + 4, sizes
