"""Placement records shared by propagation, rules and expansion.

``node.meta["spmd"]`` holds a :class:`NodeSharding`; tensor placements are DTensor's ``DTensorSpec``
with the *global* tensor metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = [
    "AS_PRODUCED",
    "local_slice",
    "shards_dim","NodeSharding", "concrete", "tensor_meta", "tensor_spec", "local_shape", "local_offset", "replicate"]


@dataclass
class NodeSharding:
    """Placements of one node of the global graph.

    ``inputs``: the spec each tensor argument must have, in ``pytree.tree_flatten((args, kwargs))``
    order of the node's tensor arguments (None for arguments that are not tensors).
    ``output``: a ``DTensorSpec``, a tuple/list of them (multi-output ops), a ``DSymInt`` (sym nodes)
    or None.
    """

    inputs: tuple[Optional[DTensorSpec], ...] = ()
    output: Any = None
    # Marker nodes whose gradient stays rank-local (DDP ignored_modules): no redistribution.
    rank_local: bool = field(default=False)
    # Random ops: the spmd_expand.rng.RandomOp that expansion emits as a global draw plus this
    # rank's part of it (None for every other node).
    random: Any = field(default=None)
    # For ops whose sharded form is not the op run on shards (DTensor's custom op handlers, e.g.
    # loss parallel): a function of the local values of the node's tensor arguments (in ``inputs``
    # order, already redistributed) returning its local output(s); expansion traces and inlines it.
    local_op: Optional[Callable[..., Any]] = field(default=None)


def concrete(x: Any) -> Any:
    """The example value of a SymInt/SymFloat (its hint), ``x`` otherwise."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.hint
    return x


def tensor_meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(
        torch.Size([int(concrete(s)) for s in val.shape]), tuple(int(concrete(s)) for s in val.stride()), val.dtype
    )


# Placement request meaning "keep whatever placement the value has", e.g. unreduced (Partial)
# gradients while gradient sync is off.
AS_PRODUCED = "as-produced"


# Building a DTensorSpec is slow (its __setattr__ validates every field), and a model of repeated
# layers asks for the same few specs thousands of times; specs are immutable, so they are shared.
_SPECS: dict[tuple, DTensorSpec] = {}


def spec_with_meta(mesh: DeviceMesh, placements: Sequence[Placement], meta: TensorMeta) -> DTensorSpec:
    """The (shared) ``DTensorSpec`` of a global tensor with ``meta`` and ``placements`` on ``mesh``."""
    key = (id(mesh), tuple(placements), tuple(meta.shape), meta.stride, meta.dtype)
    spec = _SPECS.get(key)
    if spec is None or spec.mesh is not mesh:
        spec = _SPECS[key] = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return spec


def tensor_spec(mesh: DeviceMesh, placements: Sequence[Placement], val: torch.Tensor) -> DTensorSpec:
    """A ``DTensorSpec`` for a global tensor ``val`` (fake, possibly with symbolic sizes)."""
    return spec_with_meta(mesh, placements, tensor_meta(val))


def local_offset(spec: DTensorSpec) -> list[int]:
    """Global index of this rank's first element along each dim."""
    _, offset = compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, spec.placements)
    return list(offset)


def shards_dim(placement: Placement) -> bool:
    """Whether ``placement`` splits a tensor dim: ``Shard`` or ``_StridedShard`` (not a subclass of it)."""
    return isinstance(placement, (Shard, _StridedShard))


def local_slice(tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's part of a global ``tensor`` (e.g. a batch) under ``placements`` on ``mesh``.

    The chunking is DTensor's (``compute_local_shape_and_global_offset``); no communication.
    Returns a view of ``tensor``.
    """
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tuple(placements))
    return tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def local_shape(spec: DTensorSpec) -> list[int]:
    """This rank's local shape of a tensor with ``spec`` (DTensor's uneven-sharding rule)."""
    shape, _ = compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, spec.placements)
    return list(shape)


def replicate(mesh: DeviceMesh) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(mesh.ndim))
