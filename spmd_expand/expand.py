"""Expand the annotated global graph into this rank's local graph.

Every op of the global graph runs on local shards. Where a node's input must change placement, a
collective subgraph is spliced in: it is traced once with ``make_fx`` over DTensor's own
``redistribute_local_tensor`` (so the plan is DTensor's: all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single from ``torch.ops._c10d_functional``, each with its
``wait_tensor``), cached per (source placements, target placements, global shape, dtype), and
inlined. A value is redistributed to a given placement at most once.

Size arguments are rewritten to local sizes from the output's placement (see
:mod:`spmd_expand.dsymint` for which value a DSymInt contributes where). Random ops are drawn at their
global size on every rank and sliced to this rank's part (see :mod:`spmd_expand.rng`).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor._redistribute import _gen_transform_infos, _TransformInfo, redistribute_local_tensor
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from . import rng
from .errors import PlacementError, first_line, node_error
from .dsymint import DSymInt, local_strides
from .ops import GRADIENT, LAYOUT, SEQUENCE_FIRST, UNSHARD
from .rules import NCHW_SCALAR_ARGS, SIZE_ARG
from .spec import NodeSharding, local_offset, local_shape, shards_dim

__all__ = ["expand", "RedistributeCache"]

aten = torch.ops.aten


def _fresh_masks(spec: DTensorSpec) -> DTensorSpec:
    """``spec`` with new ``_MaskPartial`` objects, so tracing never touches DTensor's shared mask state."""
    placements = tuple(
        _MaskPartial(reduce_op=p.reduce_op, offset_shape=p.offset_shape, offset_dim=p.offset_dim)
        if isinstance(p, _MaskPartial)
        else p
        for p in spec.placements
    )
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _strided_to_replicate(src: DTensorSpec, dst: DTensorSpec) -> Optional[Callable]:
    """A traceable redistribution out of ``_StridedShard(d, sf)`` on one mesh dim into ``Replicate()``
    there, for even sizes; else None.

    DTensor's own path computes shard offsets with ``.tolist()``, which cannot be traced on fake
    tensors in torch 2.13. With even sizes the layout is simple: dim d of the local tensor *before*
    this mesh dim (after any outer ``Shard(d)``, e.g. a batch split over "dp" flattened with a
    sequence split over "tp"), viewed as [sf, W, c], holds [:, rank, :] on each rank, so an all-gather
    of the sf pieces and an interleave restore it. Whatever else changes (e.g. the outer ``Shard(d)``
    gathered too) is DTensor's ordinary redistribution afterwards.
    """
    strided_dims = [m for m, p in enumerate(src.placements) if isinstance(p, _StridedShard)]
    if len(strided_dims) != 1:
        return None
    m = strided_dims[0]
    strided = src.placements[m]
    if not isinstance(dst.placements[m], Replicate):
        return None
    size, dim, pieces = src.mesh.size(m), strided.dim, strided.split_factor
    outer = [i for i, p in enumerate(src.placements) if i != m and isinstance(p, Shard) and p.dim == dim]
    if any(i > m for i in outer):
        return None
    local = src.tensor_meta.shape[dim]
    for i in outer:
        if local % src.mesh.size(i):
            return None
        local //= src.mesh.size(i)
    if local % (pieces * size):
        return None
    middle = DTensorSpec(src.mesh, tuple(Replicate() if i == m else p for i, p in enumerate(src.placements)), tensor_meta=src.tensor_meta)

    def fn(t: torch.Tensor) -> torch.Tensor:
        x = t.movedim(dim, 0)
        rest = x.shape[1:]
        chunk = x.shape[0] // pieces
        gathered = funcol.all_gather_single(x.contiguous(), gather_dim=0, group=(src.mesh, m))
        full = gathered.reshape(size, pieces, chunk, *rest).transpose(0, 1).reshape(size * pieces * chunk, *rest)
        full = full.movedim(0, dim)
        if middle.placements != dst.placements:
            full = redistribute_local_tensor(full, middle, dst)
        return full

    return fn


def _uneven_shard(src: DTensorSpec, dst: DTensorSpec) -> Optional[Callable]:
    """A redistribution of constant size in the mesh for uneven shards: DTensor's own plan (its
    per-mesh-dim steps, ``_gen_transform_infos``), with each step that moves an uneven ``Shard(d)``,
    ``Partial("sum")`` -> ``Shard(d)`` (reduce-scatter) or ``Shard(d)`` -> ``Replicate()``
    (all-gather), done by :func:`_uneven_step`. None when no step is uneven (DTensor's path is then
    constant-size) or DTensor's plan passes through a state this cannot name.

    DTensor pads uneven shards one piece at a time: it splits the tensor into the W pieces, pads each
    and concatenates them (reduce-scatter), or chunks the gathered tensor and unpads each piece
    (all-gather), so a graph holds O(W) nodes per redistribution (W=512: 27,168 ``constant_pad_nd``
    for 64 gradients). Several mesh dims may change at once (FSDP+TP: a gradient ``Partial(sum),
    Replicate()`` -> ``Shard(0), Shard(0)``); each step runs on the logical tensor of its mesh dim.
    """
    mesh = src.mesh
    steps: list[Callable] = []
    current, uneven = tuple(src.placements), False
    for info in _gen_transform_infos(src, dst):
        m, (before, after) = info.mesh_dim, info.src_dst_placements
        if current[m] != before:
            return None
        after_step = current[:m] + (after,) + current[m + 1 :]
        a = DTensorSpec(mesh, current, tensor_meta=src.tensor_meta)
        b = DTensorSpec(mesh, after_step, tensor_meta=src.tensor_meta)
        # The intermediate specs name DTensor's state only if DTensor plans this step the same way.
        if [(i.mesh_dim, i.src_dst_placements) for i in _gen_transform_infos(a, b)] != [(m, (before, after))]:
            return None
        found = _gathered_or_scattered_dim(info)
        if found is not None and any(
            shards_dim(p) and p.dim == found[0] and (k > m or isinstance(p, _StridedShard))
            for k, p in enumerate(current)
        ):
            return None  # a later (or strided) shard of the same dim: not a piece of the logical tensor
        step = _uneven_step(src.tensor_meta.shape, mesh, m, *found, current) if found is not None else None
        uneven |= step is not None
        steps.append(step or functools.partial(redistribute_local_tensor, current_spec=a, target_spec=b))
        current = after_step
    if not uneven:
        return None

    def fn(t: torch.Tensor) -> torch.Tensor:
        for step in steps:
            t = step(t)
        return t

    return fn


def _gathered_or_scattered_dim(info: _TransformInfo) -> Optional[tuple[int, bool]]:
    """(dim d, whether all-gathered) for ``Partial("sum")`` -> ``Shard(d)`` and ``Shard(d)`` ->
    ``Replicate()``; None for any other step."""
    before, after = info.src_dst_placements
    if type(before) is Partial and before.reduce_op == "sum" and type(after) is Shard:
        return after.dim, False
    if type(before) is Shard and type(after) is Replicate:
        return before.dim, True
    return None


def _uneven_step(
    shape: Sequence[int], mesh: DeviceMesh, m: int, dim: int, gather: bool, current: tuple
) -> Optional[Callable]:
    """Mesh dim ``m``'s step of a plan for a tensor of global ``shape``, from placements ``current``,
    as one pad, one collective and one narrow: it reduce-scatters (``Partial("sum")`` -> ``Shard(dim)``)
    or, with ``gather``, all-gathers (``Shard(dim)`` -> ``Replicate()``) a dim the mesh dim's size does
    not divide. None when it divides (DTensor's own step is one collective).

    The step runs on the logical tensor of its mesh dim: the global tensor as the mesh dims before it
    shard it (DTensor's default left-to-right shard order; no later mesh dim may shard ``dim``). With
    DTensor's chunking (``torch.chunk``: pieces of c = ceil(n/W), the last non-empty piece shorter, any
    after it empty), padding the whole tensor to W*c rows and scattering gives each rank its piece
    padded to c rows, and the real rows of a gathered padded tensor are its first n.
    """
    rest = tuple(Replicate() for _ in range(mesh.ndim - m - 1))

    def size_of_dim(placements: tuple) -> int:
        return int(compute_local_shape_and_global_offset(shape, mesh, current[:m] + placements + rest)[0][dim])

    n, size = size_of_dim((Replicate(),)), mesh.size(m)
    if n % size == 0:
        return None  # DTensor's own path is one collective
    real = size_of_dim((Shard(dim),))  # this rank's piece
    chunk = -(-n // size)
    group = (mesh, m)

    def rows_first(x: torch.Tensor, rows: int) -> torch.Tensor:
        """Dim ``dim`` of ``x`` moved first, padded with ``rows`` zero rows at its end, contiguous."""
        x = x.movedim(dim, 0) if dim else x
        # F.pad's list runs from the last dim backwards: the last pair pads dim 0 at its end.
        x = torch.nn.functional.pad(x, [0, 0] * (x.ndim - 1) + [0, rows]) if rows else x
        return x.contiguous()

    def rows_back(x: torch.Tensor) -> torch.Tensor:
        return x.movedim(0, dim).contiguous() if dim else x

    if gather:

        def fn(t: torch.Tensor) -> torch.Tensor:
            full = funcol.all_gather_single(rows_first(t, chunk - real), gather_dim=0, group=group)
            return rows_back(full.narrow(0, 0, n))

    else:

        def fn(t: torch.Tensor) -> torch.Tensor:
            piece = funcol.reduce_scatter_single(rows_first(t, chunk * size - n), "sum", scatter_dim=0, group=group)
            return rows_back(piece.narrow(0, 0, real) if real < chunk else piece)

    return fn


def _rescale_partial(src: DTensorSpec, dst: DTensorSpec) -> Optional[Callable]:
    """A redistribution that turns ``Partial("sum")`` into ``Partial("avg")`` (or back) on some mesh
    dims, which DTensor's planner refuses: scale the local value by size (or 1/size) there, then let
    DTensor do whatever else changes. None when no mesh dim needs it.

    Arises where a graph must return the placement eager DTensor produced (a loss DTensor computes as
    ``Partial("avg")``) for a value propagation left as ``Partial("sum")``.
    """
    factor, changed = 1.0, False
    for m, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if type(a) is Partial and type(b) is Partial and a.reduce_op != b.reduce_op:
            ops = (a.reduce_op, b.reduce_op)
            # The value of Partial("sum") is the sum of the locals, of Partial("avg") their mean.
            if ops == ("sum", "avg"):
                factor *= src.mesh.size(m)
            elif ops == ("avg", "sum"):
                factor /= src.mesh.size(m)
            else:
                return None
            changed = True
    if not changed:
        return None
    middle = DTensorSpec(
        src.mesh,
        tuple(b if type(a) is Partial and type(b) is Partial else a for a, b in zip(src.placements, dst.placements)),
        tensor_meta=src.tensor_meta,
    )

    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t * factor
        return t if middle.placements == dst.placements else redistribute_local_tensor(t, middle, dst)

    return fn


def _masks(spec: DTensorSpec) -> list:
    return [p for p in spec.placements if isinstance(p, _MaskPartial)]


def _redistribute_error(error: Exception, at: fx.Node, node: fx.Node, src: DTensorSpec, dst: DTensorSpec) -> PlacementError:
    """A :class:`PlacementError` for a redistribution DTensor cannot make (its planning raised), naming
    the value, both placements, the user's line and what usually leads there."""
    strided = any(isinstance(p, _StridedShard) for p in (*src.placements, *dst.placements))
    if strided:
        fix = (
            "a _StridedShard comes from flattening or reshaping a tensor split on a dim that is not the first "
            "of the dims merged: a sequence-parallel activation (batch, seq, hidden) entering a Linear, "
            "sequence-first data under batch_dim=1 flattened to tokens ((seq, batch) -> seq * batch), or a "
            "split view of the batch (`x.view(2, n // 2, -1)`); DTensor redistributes some of these only "
            "from values. Put the split dim first before flattening (`x.transpose(0, 1).flatten(0, 1)`, "
            "and the targets alike), or make its size divisible by the mesh dim's size (the sequence length "
            "by the tensor-parallel degree; the local batch by the number of pieces)"
        )
    elif any(p.is_shard() for p in src.placements) and any(p.is_partial() for p in dst.placements):
        fix = (
            "a sharded value is added to a partial one (e.g. a gradient reduce-scattered inside backward, "
            "under FSDP's mixed precision, added to one accumulated without gradient sync, which is still "
            "partial): run the accumulating calls with gradient sync on, or without mp_policy"
        )
    else:
        fix = "choose placements for this value (the plan, or a `layout` at the module boundary) that DTensor can redistribute"
    return node_error(
        PlacementError, at,
        f"DTensor cannot redistribute {node.name} of shape {list(src.tensor_meta.shape)} from {src.placements} to "
        f"{dst.placements}: {type(error).__name__}: {first_line(error)}",
        placements=[src.placements, dst.placements], fix=fix,
    )


class RedistributeCache:
    """Traced redistribution subgraphs keyed by (src placements, dst placements, shape, dtype, mesh).

    One cache may serve many expansions on the same rank (e.g. the first-call and steady-state graphs).

    DTensor's vocab-parallel embedding uses ``_MaskPartial``: partitioning the indices computes a mask
    that reducing the embedding's output later applies (eager DTensor passes it through shared
    placement state). Here the mask is a graph value: a redistribution *to* a ``_MaskPartial`` returns
    ``(value, mask)``, and one *from* it takes ``(value, mask)``.
    """

    def __init__(self) -> None:
        self._graphs: dict[tuple, fx.GraphModule] = {}

    def get(self, src: DTensorSpec, dst: DTensorSpec, mask_shape: Optional[list[int]] = None) -> fx.GraphModule:
        meta = src.tensor_meta
        order = _memory_order(meta.shape, meta.stride)
        key = (src.placements, dst.placements, tuple(meta.shape), meta.dtype, order, src.mesh, tuple(mask_shape or ()))
        gm = self._graphs.get(key)
        if gm is None:
            shape = local_shape(src)  # outside fake mode: DTensor computes offsets with real tensors
            with FakeTensorMode():
                examples = [torch.empty(shape, dtype=meta.dtype)]
                if mask_shape is not None:
                    examples.append(torch.empty(mask_shape, dtype=torch.bool))
            src, dst = _fresh_masks(src), _fresh_masks(dst)
            if _masks(src):
                def fn(t, m):
                    for p in _masks(src):
                        p.mask_buffer.materialize_mask(m)
                    return redistribute_local_tensor(t, src, dst)

            elif _masks(dst):
                def fn(t):
                    out = redistribute_local_tensor(t, src, dst)
                    return out, _masks(dst)[0].mask_buffer.data

            else:
                fn = (
                    _strided_to_replicate(src, dst) or _rescale_partial(src, dst) or _uneven_shard(src, dst)
                    or (lambda t: redistribute_local_tensor(t, src, dst))
                )
            gm = make_fx(_keeping_memory_order(fn, order), tracing_mode="fake")(*examples)
            # DTensor's local chunking (Replicate -> Shard) splits into W pieces and keeps one.
            gm.graph.eliminate_dead_code()
            gm.recompile()
            self._graphs[key] = gm
        return gm


def _memory_order(shape: Sequence[int], stride: Sequence[int]) -> Optional[tuple[int, ...]]:
    """The dims of a dense global tensor from outermost to innermost in memory, when that is not
    their logical order (a transpose made contiguous; in ``nn.MultiheadAttention`` the CPU
    flash-attention output, laid out as [seq, batch, heads, head_dim] behind its [batch, heads, seq,
    head_dim] shape). None for a
    row-major or a non-dense tensor. Dims of size 1 have no place in memory: they keep theirs."""
    sized = [d for d in range(len(shape)) if shape[d] > 1]
    order = sorted(sized, key=lambda d: -stride[d])  # stable: equal strides only for size-1 dims
    expected = 1
    for d in reversed(order):
        if stride[d] != expected:
            return None
        expected *= shape[d]
    if order == sized:
        return None
    it = iter(order)
    return tuple(next(it) if shape[d] > 1 else d for d in range(len(shape)))


def _keeping_memory_order(fn: Callable, order: Optional[tuple[int, ...]]) -> Callable:
    """``fn`` (a redistribution of a local tensor), with its result laid out in memory in the global
    tensor's dim order ``order`` (:func:`_memory_order`; None: ``fn`` itself).

    The global graph was traced on the global tensor, and a ``view`` in it may rely on that layout
    (``attn.permute(2, 0, 1, 3).view(S * B, E)`` in ``nn.MultiheadAttention`` merges dims that are
    adjacent only in the flash-attention output's memory order). Locally the value may have another
    layout (attention run on all-gathered, row-major inputs returns a row-major output), and DTensor's
    redistributions return row-major tensors (``all_gather``'s output, a chunk of a row-major tensor
    made contiguous), on which such a view fails: the result is copied into the global dim order
    where it differs (one copy of the local tensor), and returned as is where it already has it. A result that is a tuple (a value and its
    ``_MaskPartial`` mask) has its first element laid out.
    """
    if order is None:
        return fn
    inverse = sorted(range(len(order)), key=order.__getitem__)

    def lay_out(t: torch.Tensor) -> torch.Tensor:
        physical = t.permute(order)
        return t if physical.is_contiguous() else physical.contiguous().permute(inverse)

    @functools.wraps(fn)
    def keeping_order(*args: torch.Tensor) -> Any:
        out = fn(*args)
        return (lay_out(out[0]), *out[1:]) if isinstance(out, tuple) else lay_out(out)

    return keeping_order


def _flatten_specs(spec: Any) -> list:
    return spec if isinstance(spec, (list, tuple)) else [spec]


class _Expander:
    def __init__(self, global_gm: fx.GraphModule, cache: RedistributeCache):
        self.global_gm = global_gm
        self.cache = cache
        self.graph = fx.Graph()
        self.local: dict[fx.Node, Any] = {}
        self.redistributed: dict[tuple, fx.Node] = {}
        self.attrs: dict[str, torch.Tensor] = {}
        # Node whose output is a _MaskPartial value -> the local mask node that goes with it.
        self.mask_of: dict[fx.Node, fx.Node] = {}

    def spmd(self, node: fx.Node) -> NodeSharding:
        return node.meta["spmd"]

    def redistribute(
        self, node: fx.Node, dst: Optional[DTensorSpec], reuse: bool = True, consumer: Optional[fx.Node] = None
    ) -> fx.Node:
        """``node``'s local value with placements ``dst``; with ``reuse``, made at most once.

        The spliced nodes carry the consumer's ``meta["custom"]`` (e.g. its backward-region tag).
        """
        src = self.spmd(node).output
        local = self.local[node]
        if dst is None or not isinstance(src, DTensorSpec) or src.placements == dst.placements:
            return local
        key = (node, dst.placements)
        if key not in self.redistributed or not reuse:
            mask = self.mask_of.get(node) if _masks(src) else None
            mask_shape = list(mask.meta["val"].shape) if mask is not None else None
            try:
                sub = self.cache.get(src, dst, mask_shape)
            except Exception as e:  # noqa: BLE001 - DTensor's redistribute planning refused this pair
                raise _redistribute_error(e, consumer if consumer is not None else node, node, src, dst) from e
            meta = {"spmd_redistribute": (src.placements, dst.placements), "stack_trace": node.meta.get("stack_trace")}
            if consumer is not None and "custom" in consumer.meta:
                meta["custom"] = consumer.meta["custom"]
            if consumer is not None and consumer.target in (GRADIENT, UNSHARD):
                # The parameter this redistribution gathers or reduces (for passes: bucketing by block).
                meta["fqn"] = consumer.args[1]
            self.redistributed[key] = self._inline(sub, [local, mask], meta)
        result = self.redistributed[key]
        if isinstance(result, tuple):  # partitioned to a _MaskPartial: (value, mask)
            result, mask = result
            if consumer is not None:
                self.mask_of[consumer] = mask
        return result

    def _inline(self, sub: fx.GraphModule, inputs: list, meta: dict) -> Any:
        """Copy ``sub``'s nodes into the local graph over ``inputs``; returns what ``sub`` returns
        (a node, or a tuple of them). Every copied node gets ``meta``."""
        env: dict[fx.Node, Any] = {}
        values = iter(inputs)
        result = None
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(values)
            elif n.op == "get_attr":
                name = f"_redistribute_constant_{len(self.attrs)}"
                self.attrs[name] = getattr(sub, n.target)
                env[n] = self.graph.get_attr(name)
            elif n.op == "output":
                out = n.args[0]
                result = env[out] if isinstance(out, fx.Node) else tuple(env[o] for o in out)
            else:
                new = self.graph.node_copy(n, lambda x: env[x])
                new.meta.update(meta)
                env[n] = new
        return result

    def local_op(self, node: fx.Node, sharding: NodeSharding, inputs: list) -> Any:
        """The local graph of ``sharding.local_op`` over ``inputs`` (local values of the node's tensor
        arguments, with the placements ``sharding.inputs`` names), traced on fake local shards."""
        specs = [s for s in sharding.inputs if s is not None]
        shapes = [local_shape(s) for s in specs]  # outside fake mode, as in RedistributeCache.get
        with FakeTensorMode():
            examples = [torch.empty(shape, dtype=s.tensor_meta.dtype) for shape, s in zip(shapes, specs)]
        traced = make_fx(sharding.local_op, tracing_mode="fake")(*examples)
        # Handlers write into fresh buffers (index_put_); functionalized, the local graph stays functional.
        sub = make_fx(torch.func.functionalize(traced, remove="mutations"), tracing_mode="fake")(*examples)
        meta = {"stack_trace": node.meta.get("stack_trace"), **({"custom": node.meta["custom"]} if "custom" in node.meta else {})}
        result = self._inline(sub, inputs, meta)
        if isinstance(result, tuple):
            # A multi-output op: later getitem nodes index the local results.
            return list(result)
        return result

    def run(self) -> fx.GraphModule:
        for node in self.global_gm.graph.nodes:
            handler = getattr(self, node.op)
            handler(node)
        self.graph.eliminate_dead_code()
        # Lazy: Python code is generated on first call, so passes and Inductor never pay for it.
        return _LazyGraphModule(self.attrs, self.graph)

    def placeholder(self, node: fx.Node) -> None:
        new = self.graph.placeholder(node.name)
        new.meta["spmd"] = self.spmd(node)
        self.local[node] = new

    def get_attr(self, node: fx.Node) -> None:
        self.attrs[node.target] = getattr(self.global_gm, node.target)
        new = self.graph.get_attr(node.target)
        new.meta["spmd"] = self.spmd(node)
        self.local[node] = new

    def output(self, node: fx.Node) -> None:
        wanted = self.spmd(node).inputs
        self.graph.output([self.redistribute(a, w) for a, w in zip(node.args[0], wanted)])

    def call_function(self, node: fx.Node) -> None:
        sharding = self.spmd(node)
        if isinstance(sharding.output, DSymInt):
            self.local[node] = sharding.output  # resolved per consumer below
            return
        if node.target is operator.getitem and isinstance(self.local[node.args[0]], (tuple, list)):
            # Outputs emitted one by one (random ops) or of an inlined local_op.
            self.local[node] = self.local[node.args[0]][node.args[1]]
            return
        if node.target is operator.getitem:
            new = self.graph.call_function(operator.getitem, (self.local[node.args[0]], node.args[1]))
            new.meta["spmd"] = sharding
            self.local[node] = new
            self._inherit_mask(node)
            return
        if node.target is GRADIENT:
            # The gradient marker is the redistribution itself (or nothing, for rank-local gradients).
            self.local[node] = self.redistribute(
                node.args[0], None if sharding.rank_local else sharding.inputs[0], consumer=node
            )
            return
        if node.target is LAYOUT:
            self.local[node] = self.redistribute(node.args[0], sharding.inputs[0], consumer=node)
            return
        if node.target is SEQUENCE_FIRST:
            self.local[node] = self.local[node.args[0]]
            return
        if sharding.random is not None:
            self.local[node] = self._random(node, sharding)
            return
        if node.target is UNSHARD:
            # Each unshard marker is its own gather point: a parameter re-gathered for backward
            # (reshard_after_forward) must not reuse the forward's gathered copy.
            self.local[node] = self.redistribute(node.args[0], sharding.inputs[0], reuse=False, consumer=node)
            return

        leaves, tree = pytree.tree_flatten((node.args, node.kwargs))
        wanted = list(sharding.inputs) + [None] * (len(leaves) - len(sharding.inputs))
        new_leaves = []
        for leaf, spec in zip(leaves, wanted):
            if isinstance(leaf, fx.Node):
                value = self.local[leaf]
                new_leaves.append(
                    value.global_value if isinstance(value, DSymInt) else self.redistribute(leaf, spec, consumer=node)
                )
            else:
                new_leaves.append(leaf)
        if sharding.local_op is not None:
            tensors = [v for v, spec in zip(new_leaves, wanted) if spec is not None]
            self.local[node] = self.local_op(node, sharding, tensors)
            return
        args, kwargs = pytree.tree_unflatten(new_leaves, tree)
        target, args = self.local_size_args(node, list(args), sharding)
        new = self.graph.call_function(target, tuple(args), kwargs)
        new.meta["spmd"] = sharding
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        if "custom" in node.meta:
            new.meta["custom"] = node.meta["custom"]
        self.local[node] = new
        self._inherit_mask(node)

    def _random(self, node: fx.Node, sharding: NodeSharding) -> Any:
        """A random op: drawn at global size on every rank, this rank keeps its part (see rng)."""

        def local_value(leaf: fx.Node, spec: Optional[DTensorSpec]) -> Any:
            value = self.local[leaf]
            return value.global_value if isinstance(value, DSymInt) else self.redistribute(leaf, spec, consumer=node)

        return rng.emit_global_draw(
            self.graph, node, sharding, sharding.random, lambda n: self.spmd(n).output, local_value
        )

    def _inherit_mask(self, node: fx.Node) -> None:
        """A _MaskPartial output keeps the mask of the input it came from (or of its partitioned input)."""
        if node in self.mask_of or not any(_masks(s) for s in _flatten_specs(self.spmd(node).output) if isinstance(s, DTensorSpec)):
            return
        for arg in node.all_input_nodes:
            if arg in self.mask_of:
                self.mask_of[node] = self.mask_of[arg]
                return

    def local_size_args(self, node: fx.Node, args: list, sharding: NodeSharding) -> tuple[Any, list]:
        """(op, args) with global sizes rewritten to this rank's local sizes where the output is sharded."""
        target = node.target
        out = sharding.output
        if target in (aten.split.Tensor, aten.split_with_sizes.default):
            # Pieces of a split along a sharded dim are sharded too: split by their local sizes.
            dim = args[2] if len(args) > 2 else 0
            sizes = [local_shape(piece)[dim] for piece in out]
            args[1] = sizes[0] if target is aten.split.Tensor else sizes
            return target, args
        if target in NCHW_SCALAR_ARGS:
            # GroupNorm: N (and C, HxW) of the input as this rank holds it.
            tensor_index, n_index = NCHW_SCALAR_ARGS[target]
            shape = local_shape(sharding.inputs[tensor_index])
            args[n_index : n_index + 3] = [shape[0], shape[1], math.prod(shape[2:])]
            return target, args
        if not isinstance(out, DTensorSpec) or not any(shards_dim(p) for p in out.placements):
            return target, args
        shape = local_shape(out)
        if target in SIZE_ARG:
            index = SIZE_ARG[target]
            args[index] = shape
            if target in (aten.empty_strided.default, aten.new_empty_strided.default):
                args[index + 1] = local_strides(out.tensor_meta.shape, out.tensor_meta.stride, shape)
        elif target is aten.repeat.default:
            src = self.spmd(node.args[0]).output
            src_shape = [1] * (len(shape) - len(src.tensor_meta.shape)) + local_shape(src)
            args[1] = [o // i for o, i in zip(shape, src_shape)]
        elif target in (aten.arange.default, aten.arange.start):
            # This rank's slice of arange(start, end): the same values, shifted by its global offset.
            start = 0 if target is aten.arange.default else args[0]
            first = start + local_offset(out)[0]
            return aten.arange.start, [first, first + shape[0]]
        return target, args


def expand(global_gm: fx.GraphModule, cache: Optional[RedistributeCache] = None) -> fx.GraphModule:
    """Build this rank's local graph from a graph annotated by :func:`spmd_expand.propagate.propagate`.

    Inputs of the local graph are the local shards of the global graph's inputs, in the same order;
    outputs are local values with the placements propagation asked for (replicated returns are full).
    Nodes of a redistribution carry ``meta["spmd_redistribute"]`` (source and target placements) and,
    when it gathers or reduces a parameter (its ``unshard`` or ``gradient`` marker), ``meta["fqn"]``.
    The local graph holds ``torch.ops._c10d_functional`` collectives and runs under torch.distributed.
    """
    return _Expander(global_gm, cache or RedistributeCache()).run()
