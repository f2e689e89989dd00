"""DSymInt: global/local values of sizes read from sharded tensors, and arithmetic on them.

Pure unit tests over ``DTensorSpec`` built on a fake 4-rank mesh (this process is rank 0).
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from spmd_expand.dsymint import DSymInt, apply_arithmetic, from_size_node, local_strides
from spmd_expand.spec import local_shape

aten = torch.ops.aten

B_LOCAL = 2  # rank 0's batch; the global batch is 4 * B_LOCAL on the 4-rank mesh
B = 4 * B_LOCAL
BATCH = DSymInt(B, B_LOCAL, (0,))  # a batch size sharded over mesh dim 0


def contiguous_strides(shape):
    strides, running = [], 1
    for s in reversed(shape):
        strides.append(running)
        running *= s
    return tuple(reversed(strides))


def spec(mesh, shape, placements, stride=None):
    stride = contiguous_strides(shape) if stride is None else tuple(stride)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, torch.float32))


def size_of(op, s, *args):
    return from_size_node(op, s, local_shape(s), args)


@pytest.fixture(scope="module")
def mesh_2d(fake_mesh):
    """A 2 x 2 mesh over the same fake world of 4."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))


# ---------------------------------------------------------------- arithmetic
def test_sharded_times_constant_keeps_local_value_and_mesh_dims():
    r = apply_arithmetic(operator.mul, [BATCH, 3])
    assert r == DSymInt(3 * B, 3 * B_LOCAL, (0,))
    # The other operand order (`T * B`) is the same size of the same shard.
    assert apply_arithmetic(operator.mul, [3, BATCH]) == DSymInt(3 * B, 3 * B_LOCAL, (0,))


def test_sharded_times_replicated_dsymint_stays_sharded():
    t = DSymInt(5, 5, ())  # e.g. a dynamic but replicated sequence length
    assert apply_arithmetic(operator.mul, [BATCH, t]) == DSymInt(5 * B, 5 * B_LOCAL, (0,))


def test_sharded_plus_constant_is_global_only():
    r = apply_arithmetic(operator.add, [BATCH, 1])
    assert r == DSymInt(B + 1, B + 1, ())
    assert not r.is_sharded
    assert apply_arithmetic(operator.sub, [BATCH, 1]) == DSymInt(B - 1, B - 1, ())


def test_floordiv_by_constant_keeps_shard():
    assert apply_arithmetic(operator.floordiv, [BATCH, 2]) == DSymInt(B // 2, B_LOCAL // 2, (0,))


def test_constant_floordiv_sharded_is_global_only():
    # 16 // B is not the size of any shard.
    assert apply_arithmetic(operator.floordiv, [16, BATCH]) == DSymInt(16 // B, 16 // B, ())


def test_sharded_times_sharded_is_global_only():
    r = apply_arithmetic(operator.mul, [BATCH, BATCH])
    assert r == DSymInt(B * B, B * B, ())


def test_truediv_and_comparisons_use_global_values():
    assert apply_arithmetic(operator.truediv, [BATCH, 2]) == DSymInt(B / 2, B / 2, ())
    assert apply_arithmetic(operator.eq, [BATCH, B]).global_value is True
    assert apply_arithmetic(operator.eq, [BATCH, B_LOCAL]).global_value is False


def test_arithmetic_on_plain_numbers_is_replicated_constant():
    assert apply_arithmetic(operator.mul, [3, 4]) == DSymInt.constant(12)
    assert DSymInt.constant(7) == DSymInt(7, 7, ())
    assert not DSymInt.constant(7).is_sharded and BATCH.is_sharded


# ---------------------------------------------------------------- sources: sym_size / sym_numel / sym_stride
def test_sym_size_of_batch_dim(fake_mesh):
    x = spec(fake_mesh, (B, 16), [Shard(0)])
    assert size_of(aten.sym_size.int, x, 0) == DSymInt(B, B_LOCAL, (0,))
    assert size_of(aten.sym_size.int, x, -2) == DSymInt(B, B_LOCAL, (0,))
    assert size_of(aten.sym_size.int, x, 1) == DSymInt(16, 16, ())


def test_sym_size_uneven_shard_uses_rank_zero_local_size(fake_mesh):
    x = spec(fake_mesh, (10, 3), [Shard(0)])
    # torch's uneven rule: ceil(10 / 4) = 3 rows on rank 0.
    assert size_of(aten.sym_size.int, x, 0) == DSymInt(10, 3, (0,))


def test_sym_size_replicated_tensor_is_not_sharded(fake_mesh):
    x = spec(fake_mesh, (B, 16), [Replicate()])
    assert size_of(aten.sym_size.int, x, 0) == DSymInt(B, B, ())


def test_sym_numel_of_tensor_sharded_on_dim0(fake_mesh):
    x = spec(fake_mesh, (B, 3, 5), [Shard(0)])
    assert size_of(aten.sym_numel.default, x) == DSymInt(B * 15, B_LOCAL * 15, (0,))


def test_sym_numel_of_replicated_tensor(fake_mesh):
    x = spec(fake_mesh, (B, 3), [Replicate()])
    assert size_of(aten.sym_numel.default, x) == DSymInt(B * 3, B * 3, ())


def test_sym_stride_of_contiguous_btc_sharded_on_batch(fake_mesh):
    T, C = 3, 5
    x = spec(fake_mesh, (B, T, C), [Shard(0)])
    # Sharding the outermost dim changes no stride: stride(0) = T*C globally and locally.
    assert size_of(aten.sym_stride.int, x, 0) == DSymInt(T * C, T * C, ())
    assert size_of(aten.sym_stride.int, x, 1) == DSymInt(C, C, ())
    assert size_of(aten.sym_stride.int, x, 2) == DSymInt(1, 1, ())


def test_sym_stride_of_tensor_sharded_on_inner_dim(fake_mesh):
    x = spec(fake_mesh, (6, 12), [Shard(1)])
    # The row length is split: 12 globally, 3 on each rank, so stride(0) is a sharded size.
    assert size_of(aten.sym_stride.int, x, 0) == DSymInt(12, 3, (0,))
    assert size_of(aten.sym_stride.int, x, 1) == DSymInt(1, 1, ())


def test_local_strides_contiguous_and_transposed():
    # Contiguous (B, T, C) with the batch split: the inner strides do not change.
    assert local_strides((8, 3, 5), (15, 5, 1), (2, 3, 5)) == [15, 5, 1]
    # Split on the innermost dim: every outer stride shrinks.
    assert local_strides((8, 3, 5), (15, 5, 1), (8, 3, 2)) == [6, 2, 1]
    # A transposed (column-major) global tensor keeps its memory order locally.
    assert local_strides((4, 8), (1, 4), (4, 2)) == [1, 4]


# ---------------------------------------------------------------- 2-D mesh
def test_sym_size_sharded_over_both_mesh_dims(mesh_2d):
    x = spec(mesh_2d, (B, 12), [Shard(0), Shard(0)])
    assert size_of(aten.sym_size.int, x, 0) == DSymInt(B, B // 4, (0, 1))


def test_sym_numel_and_stride_on_2d_mesh(mesh_2d):
    x = spec(mesh_2d, (B, 12), [Shard(0), Shard(1)])
    assert local_shape(x) == [B // 2, 6]
    assert size_of(aten.sym_numel.default, x) == DSymInt(B * 12, (B // 2) * 6, (0, 1))
    assert size_of(aten.sym_size.int, x, 1) == DSymInt(12, 6, (1,))
    # Row stride depends only on the inner dim's split (mesh dim "b").
    assert size_of(aten.sym_stride.int, x, 0) == DSymInt(12, 6, (1,))


def test_numel_divided_by_sharded_batch_is_replicated(fake_mesh):
    # numel // B: the per-sample element count, the same on every rank.
    x = spec(fake_mesh, (B, 3, 5), [Shard(0)])
    numel = size_of(aten.sym_numel.default, x)
    b = size_of(aten.sym_size.int, x, 0)
    per_sample = apply_arithmetic(operator.floordiv, [numel, b])
    assert per_sample.global_value == 15
    assert per_sample.local_value == 15
    assert math.prod(local_shape(x)) == B_LOCAL * 15
