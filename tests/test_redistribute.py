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


def test_a_redistributed_value_keeps_the_global_tensors_memory_order(fake_mesh):
    """In ``nn.MultiheadAttention`` the CPU flash-attention output, of shape [batch, heads, seq,
    head_dim], is laid out as [seq, batch, heads, head_dim]; the module views it as
    ``(seq * batch, embed)`` after a permute, which only that layout allows. Where attention ran
    replicated on all-gathered (row-major) inputs, its local output was row-major, and
    Replicate -> Shard(seq) returned a row-major chunk, on which the local graph's view failed: the
    chunk now has the global dim order (the values are DTensor's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from spmd_expand.expand import RedistributeCache

    B, H, S, D = 2, 3, 8, 4
    physical = torch.arange(B * S * H * D, dtype=torch.float32).reshape(S, B, H, D)
    value = physical.permute(1, 2, 0, 3)  # the global tensor: shape (B, H, S, D), seq outermost in memory
    meta = TensorMeta(value.shape, value.stride(), value.dtype)
    src = DTensorSpec(fake_mesh, (Replicate(),), tensor_meta=meta)
    dst = DTensorSpec(fake_mesh, (Shard(2),), tensor_meta=meta)
    out = RedistributeCache().get(src, dst)(value.contiguous())  # the local value, row-major
    rank, chunk = fake_mesh.get_local_rank(), S // fake_mesh.size()
    torch.testing.assert_close(out, value[:, :, rank * chunk : (rank + 1) * chunk], rtol=0, atol=0)
    assert out.permute(2, 0, 1, 3).view(chunk * B, H * D).shape == (chunk * B, H * D)
    # A row-major global tensor's redistribution is as DTensor traces it: no extra copy.
    plain = TensorMeta(torch.Size((B, H, S, D)), (H * S * D, S * D, D, 1), torch.float32)
    gm = RedistributeCache().get(DTensorSpec(fake_mesh, (Replicate(),), tensor_meta=plain), DTensorSpec(fake_mesh, (Shard(2),), tensor_meta=plain))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(torch.ops.aten.permute.default) == 0
