"""DSymInt: a symbolic size of the global graph, known as its global value and this rank's local value.

The global graph is traced with symbolic batch dims, so sizes the step reads from a batch tensor are
``sym_size`` / ``sym_numel`` / ``sym_stride`` nodes and Python arithmetic on them. Propagation evaluates
each such node to a :class:`DSymInt`. Consumers then pick a value by what the argument *is*:

* a size of a dim that is sharded in the consumer's output (``view``, ``expand``, ``full``, ...) takes
  the local value (via the output's local shape);
* anything else (a scalar in ``div(loss, numel)``, a size of a replicated dim) takes the global value.

Follows the seed of this project (torch/distributed/_spmd/distribute.py, DSymInt), with sharding
recorded per mesh dim.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .spec import shards_dim

__all__ = ["DSymInt", "SYM_SOURCE_OPS", "SYM_ARITHMETIC", "from_size_node", "apply_arithmetic", "local_strides"]

aten = torch.ops.aten


@dataclass(frozen=True)
class DSymInt:
    """A symbolic int with its global value, this rank's local value, and the mesh dims it is split over.

    ``mesh_dims`` is empty when the value is the same on every rank (then ``local_value == global_value``).
    """

    global_value: int
    local_value: int
    mesh_dims: tuple[int, ...] = ()

    @property
    def is_sharded(self) -> bool:
        return bool(self.mesh_dims)

    @staticmethod
    def constant(value: int) -> "DSymInt":
        return DSymInt(value, value, ())


SYM_SOURCE_OPS = frozenset({aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int})


def local_strides(global_shape: Sequence[int], global_stride: Sequence[int], local_shape: Sequence[int]) -> list[int]:
    """Strides of a dense local shard that keeps the global tensor's dim order in memory."""
    order = sorted(range(len(global_shape)), key=lambda d: (global_stride[d], d))  # innermost first
    strides = [0] * len(global_shape)
    running = 1
    for d in order:
        strides[d] = running
        running *= max(local_shape[d], 1)
    return strides


def from_size_node(op, spec: DTensorSpec, local_shape: Sequence[int], args: Sequence[int]) -> DSymInt:
    """DSymInt of ``sym_size(x, dim)``, ``sym_numel(x)`` or ``sym_stride(x, dim)`` for ``x`` with ``spec``."""
    shape = spec.tensor_meta.shape
    sharded_on = {
        d: tuple(m for m, p in enumerate(spec.placements) if shards_dim(p) and p.dim % max(len(shape), 1) == d)
        for d in range(len(shape))
    }
    if op is aten.sym_size.int:
        d = args[0] % len(shape)
        return DSymInt(shape[d], local_shape[d], sharded_on[d])
    if op is aten.sym_numel.default:
        mesh_dims = tuple(sorted({m for ms in sharded_on.values() for m in ms}))
        return DSymInt(math.prod(shape), math.prod(local_shape), mesh_dims)
    d = args[0] % len(shape)
    stride = spec.tensor_meta.stride
    local = local_strides(shape, stride, local_shape)[d]
    inner = tuple(sorted({m for dd, ms in sharded_on.items() if stride[dd] < stride[d] for m in ms}))
    return DSymInt(stride[d], local, inner)


def _scales(op) -> bool:
    # Multiplying or exactly dividing a sharded size by a replicated one stays a size of that shard.
    return op in (operator.mul, operator.floordiv)


SYM_ARITHMETIC: dict[Callable, Callable] = {
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.floordiv: operator.floordiv,
    operator.truediv: operator.truediv,
    operator.mod: operator.mod,
    operator.neg: operator.neg,
    operator.pow: operator.pow,
    torch.sym_float: float,
    torch.sym_int: int,
    torch.sym_max: max,
    torch.sym_min: min,
    math.ceil: math.ceil,
    math.floor: math.floor,
    operator.eq: operator.eq,
    operator.ne: operator.ne,
    operator.lt: operator.lt,
    operator.le: operator.le,
    operator.gt: operator.gt,
    operator.ge: operator.ge,
}


def apply_arithmetic(op, args: Sequence[object]) -> DSymInt:
    """Evaluate Python arithmetic on DSymInts and plain numbers.

    Global values combine as the op says. The result stays sharded (keeps local values) only for
    ``sharded * replicated`` and ``sharded // replicated`` with one sharded operand, the two forms a size
    of a sharded dim can take (``B * T``, ``B // k``); any other combination is a plain number, the
    same on every rank, whose local value is its global value.
    """
    fn = SYM_ARITHMETIC[op]
    values = [a if isinstance(a, DSymInt) else DSymInt.constant(a) for a in args]
    global_value = fn(*(v.global_value for v in values))
    sharded = [v for v in values if v.is_sharded]
    if len(sharded) == 1 and _scales(op) and (op is operator.mul or values[0].is_sharded):
        divisor = values[1].global_value
        if op is operator.floordiv and (values[0].global_value % divisor or values[0].local_value % divisor):
            return DSymInt(global_value, global_value, ())
        local_value = fn(*(v.local_value for v in values))
        return DSymInt(global_value, local_value, sharded[0].mesh_dims)
    return DSymInt(global_value, global_value, ())
