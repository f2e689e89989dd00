"""Sharding rules spmd_expand adds where torch's DTensor has none, all in this one module.

* ``spmd_expand::gradient``: the gradient marker; its output takes the plan's gradient placement.
* ``spmd_expand::unshard``: the parameter-read marker; its output takes the plan's compute placement.
* ``spmd_expand::layout``: a module-boundary marker; its output takes the requested placement.
* Factory ops (``zeros``, ``ones``, ``full``, ``empty``, ``arange``, ...) have no tensor input to take a
  placement from. Their sizes decide: a size that is a sharded :class:`~spmd_expand.dsymint.DSymInt`
  (e.g. the batch size) makes that dim ``Shard`` on the DSymInt's mesh dims; otherwise ``Replicate``.
  Any other op with no tensor argument (``linspace``, ``logspace``, ``tril_indices``, window
  functions) is ``Replicate``: every rank computes it from the same global arguments.
* Functional ops whose in-place twin has a DTensor strategy but which have none themselves (e.g.
  ``_foreach_addcdiv.Scalar``; functionalization turns the optimizers' in-place foreach ops into these):
  the twin's own DTensor strategy is registered for them. The strategy only chooses placements, which
  do not depend on whether the op writes in place.
* ``_scaled_dot_product_flash_attention_for_cpu`` (what SDPA runs on CPU) and its backward: the
  strategies DTensor has for the CUDA flash kernels (torch/distributed/tensor/_ops/_matrix_ops.py):
  all replicated, sharded on the batch dim, or sharded on the head dim (tensor parallel). Its
  keyword-only ``attn_mask`` follows the query where it spans the split dim (DTensor redistributes
  positional arguments only).
* The functional fused optimizers (``_fused_adam``, ``_fused_adamw``, ``_fused_sgd``), which DTensor's
  rule rejects in torch 2.13 (it expects a flat list of outputs): element i of every tensor list takes
  the placement of parameter i; outputs mirror the updated lists.
* ``split`` of a tensor along a dim it is sharded on, into equal pieces (micro-batches of a batch):
  DTensor would replicate the tensor first. Instead the input is laid out as
  ``_StridedShard(dim, split_factor=pieces)`` (rank r holds the r-th shard of every piece; DTensor
  plans that redistribution) and every piece comes out ``Shard(dim)``, so each micro-batch stays
  data-parallel and equals the single-device micro-batch exactly.
* ``_assert_async`` (``F.one_hot``'s range check): each rank asserts its part (see ``assert_rule``).
* ``_foreach_copy_`` and ``_foreach_copy`` (Rprop's and ASGD's state writes; eager DTensors failed on
  them too): DTensor's own strategy of ``copy_``, element by element, registered for them.
* ``lift_fresh_copy``: constants built inside the step (``torch.tensor([...])`` in a forward, as
  HuggingFace models do) are replicated values; DTensor has no rule for the copy.
* ``_log_softmax``, ``nll_loss_forward`` / ``nll_loss2d_forward`` and their backward ops, for a
  cross-entropy computed inside torch's ``loss_parallel()`` on class-sharded logits: torch implements
  these as DTensor op handlers, not strategies; :mod:`spmd_expand.loss_parallel` places them and
  runs those handlers on the local shards. Any other use keeps DTensor's rules.
* ``cat`` with legacy empty inputs (1-D, size 0, which ``torch.cat`` skips; HuggingFace's
  ``DynamicCache`` starts from one): DTensor's rule would shard them like the other inputs, on dims
  they lack. They keep their placement, and DTensor's rule places the other inputs.
* ``expand``, ``repeat`` and the ``new_*`` factories have DTensor rules, but those cannot know that a
  size came from a sharded batch dim; when one did, the output is sharded the same way instead of being
  materialized at global size and split afterwards.

* ``fill`` (``fill_.Scalar``, ``fill_.Tensor`` (``t[..., 0] = value``) and their functional forms): the
  tensor keeps its ``Shard`` or ``Replicate`` placement, a 0-d value tensor is replicated; a
  ``Partial`` tensor stays partial only when filled with a literal 0 (DTensor's own rule kept it
  partial for any value: W times the value after the reduction). Registered with DTensor's
  ``register_sharding``, replacing DTensor's rule.

* ``_weight_norm_interface_backward`` (``weight_norm``'s backward): replicated, partial in the incoming
  gradient (it is linear in it), or split along the normalized dim (registered with DTensor).

* ``unfold`` (``Tensor.unfold``) and ``unfold_backward``: split on any dim but the windowed one,
  partial, or replicated (registered with DTensor).

* ``embedding_renorm_`` / ``embedding_renorm`` (rows of an embedding rescaled to ``max_norm``, called on
  the parameter): weight and indices replicated (registered with DTensor).

* ``embedding_dense_backward``: DTensor's strategies, less the batch-split one when
  ``scale_grad_by_freq`` is set (each index's count is over the global batch); replaces DTensor's rule.

* ``unbind`` along a split dim (``for row in batch:``): the input is gathered first (a warning says so).

* ``_cdist_forward`` / ``_cdist_backward`` (``torch.cdist`` of small inputs): split on a batch dim or on
  either input's rows (registered with DTensor).

* Pooling backward ops DTensor lacks (``avg_pool2d_backward``, ``adaptive_max_pool2d_backward``, the
  3-D ones, ...): split on the batch or channel dim, or replicated, like every operand
  (registered with DTensor's ``register_sharding``, so DTensor itself places them); reflection and
  replication padding and their backward ops likewise, split on any dim before the padded ones.

* transformers' ``grouped_mm_fallback`` and its backward (the grouped-mm experts of its mixtures of
  experts, an opaque custom op; found by name, since the op exists only once transformers is
  imported): on routed token rows split over data-parallel ranks, each rank multiplies its own rows
  with the expert offsets shifted to them (:func:`grouped_mm_rule`).

* Random ops (every op tagged ``nondeterministic_seeded`` that draws): DTensor's own strategies for
  them let each rank draw its shard from its own generator, which gives every data-parallel rank the
  same "first rows" of randomness. Here the output takes the placement its inputs suggest and is
  expanded as a global draw that each rank slices (:mod:`spmd_expand.rng` says why and how); shape
  carriers are never redistributed, inputs whose values the draw reads are replicated.

A rule takes ``(node, propagator)`` and returns a ``NodeSharding``, or None to defer to DTensor.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import register_sharding

from . import rng
from . import loss_parallel
from .dsymint import DSymInt
from .errors import UnsupportedOpError, node_error, user_source_line
from .ops import GRADIENT, LAYOUT, SEQUENCE_FIRST, UNSHARD
from .spec import AS_PRODUCED, NodeSharding, local_offset, local_shape, replicate, spec_with_meta, tensor_meta, tensor_spec

__all__ = ["lookup", "SIZE_ARG", "NCHW_SCALAR_ARGS"]

aten = torch.ops.aten

# Ops whose argument at this index is a list of output sizes (rewritten to the local shape by expand).
SIZE_ARG: dict[Any, int] = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.slice_backward.default: 1,
    aten.select_backward.default: 1,
    aten.diagonal_backward.default: 1,
    aten.unfold_backward.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.new_empty_strided.default: 1,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.full.default: 0,
    aten.empty_strided.default: 0,
}

# Ops that take N, C and HxW of an input tensor as ints: op -> (position of that input, position of
# N; C and HxW follow). Expand passes this rank's local values (DTensor does the same in eager, for
# the forward, through ``op_to_scalar_shape_adjuster``); global ones fail the kernel's size check.
NCHW_SCALAR_ARGS: dict[Any, tuple[int, int]] = {
    aten.native_group_norm.default: (0, 3),
    aten.native_group_norm_backward.default: (1, 5),
}

FACTORY_OPS = frozenset(
    {
        aten.zeros.default,
        aten.ones.default,
        aten.empty.memory_format,
        aten.full.default,
        aten.empty_strided.default,
        aten.scalar_tensor.default,
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.eye.default,
        aten.eye.m,
    }
)
NEW_FACTORY_OPS = frozenset({aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default})


def _sym(prop, a: Any) -> Any:
    return prop.output_of(a) if isinstance(a, fx.Node) else a


def _sharded_placements(prop, sizes: list, ndim_offset: int = 0) -> Optional[tuple]:
    """Placements that shard dim i on the mesh dims of a sharded DSymInt at position i, if any."""
    placements = list(Replicate() for _ in range(prop.mesh.ndim))
    found = False
    for i, s in enumerate(sizes):
        if isinstance(s, DSymInt) and s.is_sharded:
            for m in s.mesh_dims:
                if isinstance(placements[m], Replicate):
                    placements[m] = Shard(i + ndim_offset)
                    found = True
    return tuple(placements) if found else None


def _out_spec(prop, node: fx.Node, placements) -> DTensorSpec:
    return tensor_spec(prop.mesh, placements, node.meta["val"])


def gradient_rule(node: fx.Node, prop):
    grad_spec = prop.output_of(node.args[0])
    wanted = prop.grad_placements(node.args[1])
    if wanted == AS_PRODUCED:
        # Gradient sync off: the gradient stays as backward produced it (usually Partial).
        return NodeSharding(inputs=(grad_spec, None), output=grad_spec)
    if wanted is None:
        # Rank-local gradient: used as this rank's value, with no reduction (DDP ignored_modules).
        out = spec_with_meta(prop.mesh, tuple(Replicate() for _ in range(prop.mesh.ndim)), grad_spec.tensor_meta)
        return NodeSharding(inputs=(grad_spec, None), output=out, rank_local=True)
    target = spec_with_meta(prop.mesh, wanted, grad_spec.tensor_meta)
    return NodeSharding(inputs=(target, None), output=target)


def unshard_rule(node: fx.Node, prop):
    """The parameter, as stored, brought to the plan's compute placement (FSDP: all-gathered)."""
    stored = prop.output_of(node.args[0])
    out = spec_with_meta(prop.mesh, prop.compute_placements(node.args[1]), stored.tensor_meta)
    return NodeSharding(inputs=(out, None), output=out)


def parse_placement(text: str, ndim: int):
    """``"R"`` -> ``Replicate()``, ``"S<d>"`` -> ``Shard(d mod ndim)`` (the ``layout`` marker's encoding)."""
    if text == "R":
        return Replicate()
    if text.startswith("S"):
        return Shard(int(text[1:]) % max(ndim, 1))
    raise ValueError(f"unknown placement encoding {text!r}")


def layout_rule(node: fx.Node, prop):
    """The input with the requested placement on one mesh dim; other mesh dims unchanged."""
    src = prop.output_of(node.args[0])
    placements = list(src.placements)
    placements[node.args[1]] = parse_placement(node.args[2], len(src.tensor_meta.shape))
    out = spec_with_meta(prop.mesh, placements, src.tensor_meta)
    return NodeSharding(inputs=(out, None, None), output=out)


def sequence_first_rule(node: fx.Node, prop):
    """The ``sequence_first`` marker: the identity, placement unchanged (checked after propagation)."""
    spec = prop.output_of(node.args[0])
    return NodeSharding(inputs=(spec, None), output=spec)


def constant_rule(node: fx.Node, prop):
    """``lift_fresh_copy`` of a constant built in the step (``torch.tensor(...)``): a copy of a
    replicated value, so it keeps the constant's placement."""
    spec = prop.output_of(node.args[0])
    return NodeSharding(inputs=(spec,), output=spec)


def assert_rule(node: fx.Node, prop):
    """``_assert_async(cond[, msg])`` (``F.one_hot``'s range check, ``torch._assert_async``): each
    rank asserts its own part of ``cond``. Where ``cond`` is split, or a partial ``all``/``max``/
    ``min`` (a product, max or min of the ranks' values), the ranks' local checks together are the
    global one; a partial sum or mean is reduced first."""
    spec = prop.output_of(node.args[0])
    placements = [
        Replicate() if isinstance(p, Partial) and p.reduce_op in ("sum", "avg") else p for p in spec.placements
    ]
    wanted = spec_with_meta(prop.mesh, placements, spec.tensor_meta)
    return NodeSharding(inputs=(wanted,) + (None,) * (len(node.args) - 1), output=None)


def _legacy_empty(prop, a) -> bool:
    return isinstance(a, fx.Node) and tuple(prop.output_of(a).tensor_meta.shape) == (0,)


def cat_rule(node: fx.Node, prop):
    """``cat`` skipping legacy empty inputs: DTensor's rule over the others (see the module docstring)."""
    tensors = node.args[0]
    if not any(_legacy_empty(prop, t) for t in tensors) or all(_legacy_empty(prop, t) for t in tensors):
        return None
    kept = [t for t in tensors if not _legacy_empty(prop, t)]
    # DTensor's rule reads target, args, kwargs and meta: the same node without the empty inputs.
    view = types.SimpleNamespace(target=node.target, args=(kept, *node.args[1:]), kwargs=node.kwargs, meta=node.meta, name=node.name)
    sharding = prop.dtensor_rule(view)
    placed = iter(sharding.inputs)
    inputs = [prop.output_of(t) if _legacy_empty(prop, t) else next(placed) for t in tensors]
    return NodeSharding(inputs=(*inputs, *placed), output=sharding.output)


def factory_rule(node: fx.Node, prop):
    if node.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        sizes = [_sym(prop, node.args[0] if node.target is aten.arange.default else node.args[1])]
        # Only `arange(end)` / `arange(0, end)` over a sharded end are split; offsets are added locally.
        start = 0 if node.target is aten.arange.default else _sym(prop, node.args[0])
        if start != 0 or node.target is aten.arange.start_step:
            sizes = [None]
    elif node.target is aten.scalar_tensor.default:
        sizes = []
    elif node.target in (aten.eye.default, aten.eye.m):
        sizes = [None, None]  # an identity is not split: its rows depend on the columns' offsets
    else:
        sizes = [_sym(prop, s) for s in node.args[0]]
    placements = _sharded_placements(prop, sizes) or tuple(Replicate() for _ in range(prop.mesh.ndim))
    return NodeSharding(inputs=(), output=_out_spec(prop, node, placements))


def sharded_size_rule(node: fx.Node, prop):
    """expand / repeat / new_* with a sharded DSymInt size over a dim the input does not split."""
    src = prop.output_of(node.args[0])
    sizes = [_sym(prop, s) for s in node.args[1]]
    if not isinstance(src, DTensorSpec) or not all(isinstance(p, Replicate) for p in src.placements):
        return None
    if node.target is aten.expand.default:
        lead = len(sizes) - len(src.tensor_meta.shape)
        # Only broadcast dims (new, or of size 1) can take a shard without moving data.
        sizes = [s if i < lead or src.tensor_meta.shape[i - lead] == 1 else None for i, s in enumerate(sizes)]
    elif node.target is aten.repeat.default:
        lead = len(sizes) - len(src.tensor_meta.shape)
        shape = [1] * lead + list(src.tensor_meta.shape)
        # A repeated dim splits into whole copies only if every rank gets a whole number of them.
        sizes = [
            s if isinstance(s, DSymInt) and shape[i] == 1 and s.global_value % _mesh_size(prop, s) == 0 else None
            for i, s in enumerate(sizes)
        ]
    placements = _sharded_placements(prop, sizes)
    if placements is None:
        return None
    return NodeSharding(inputs=(src, None), output=_out_spec(prop, node, placements))


def split_rule(node: fx.Node, prop):
    """Equal split along a dim sharded on exactly one mesh dim (see the module docstring)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    src = prop.output_of(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim %= len(src.tensor_meta.shape)
    sharded = [m for m, p in enumerate(src.placements) if isinstance(p, Shard) and p.dim == dim]
    if len(sharded) != 1 or any(isinstance(p, Shard) for m, p in enumerate(src.placements) if m not in sharded):
        return None
    mesh_dim, total = sharded[0], src.tensor_meta.shape[dim]
    size = prop.mesh.size(mesh_dim)
    if node.target is aten.split.Tensor:
        piece = int(getattr(_sym(prop, node.args[1]), "global_value", _sym(prop, node.args[1])))
        sizes = [piece] * (total // piece) if piece and total % piece == 0 else None
    else:
        sizes = [int(getattr(_sym(prop, s), "global_value", _sym(prop, s))) for s in node.args[1]]
    if not sizes or len(set(sizes)) != 1 or sizes[0] % size or len(sizes) == 1:
        return None
    strided = list(src.placements)
    strided[mesh_dim] = _StridedShard(dim, split_factor=len(sizes))
    wanted = spec_with_meta(prop.mesh, strided, src.tensor_meta)
    pieces = [tensor_spec(prop.mesh, src.placements, v) for v in node.meta["val"]]
    return NodeSharding(inputs=(wanted,), output=pieces)


def _warn_gathered_rows(node: fx.Node, what: str, dim: int) -> None:
    warnings.warn(
        f"spmd.compile: {user_source_line(node)} {what} dim {dim}, which the plan splits across ranks: it is "
        f"gathered, and every rank computes what follows for every row; a batched computation (one op over "
        f"the whole dim) keeps the rows split. If dim {dim} of the step's batch is not its samples' dim "
        f"(sequence-first data, (seq, batch, ...)), set the plan's batch_dim to the samples' dim",
        stacklevel=3,
    )


def unbind_rule(node: fx.Node, prop):
    """``unbind`` along a dim the input is split on (``for row in batch:`` iterates with it): DTensor
    refuses it, since the graph has one output per global row and a rank holds only some. The input
    is gathered on that dim first, so every rank holds every row and computes what follows for all of
    them (one device's work, with one device's values); a warning names the line."""
    src = prop.output_of(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(len(src.tensor_meta.shape), 1)
    split = [isinstance(p, Shard) and p.dim == dim for p in src.placements]
    if not any(split):
        return None
    _warn_gathered_rows(node, "unbinds (iterates over)", dim)
    gathered = [Replicate() if s else p for s, p in zip(split, src.placements)]
    wanted, output = prop._dtensor_place(node, prop.input_specs(node), {node.args[0]: spec_with_meta(prop.mesh, gathered, src.tensor_meta)})
    return NodeSharding(inputs=tuple(wanted), output=output)


def select_rule(node: fx.Node, prop):
    """``x[t]`` (``select``) along a dim the input is split on (``for t in range(x.size(0)): x[t]``, an
    RNN written over sequence-first data): DTensor's rule gathers the input first, as for ``unbind``;
    this adds the same warning. None: DTensor's rule places it."""
    src = prop.output_of(node.args[0])
    dim = node.args[1] % max(len(src.tensor_meta.shape), 1)
    if any(isinstance(p, Shard) and p.dim == dim for p in src.placements):
        _warn_gathered_rows(node, "selects one index of", dim)
    return None


def _mesh_size(prop, s: DSymInt) -> int:
    n = 1
    for m in s.mesh_dims:
        n *= prop.mesh.size(m)
    return n


def _mask_placement(mask_shape, query_shape, dim: int):
    """An attention mask's placement when the query is ``Shard(dim)``: split with the query where the
    mask spans that dim (shapes broadcast from the right), replicated where it broadcasts."""
    aligned = dim - (len(query_shape) - len(mask_shape))
    if aligned >= 0 and mask_shape[aligned] == query_shape[dim] != 1:
        return Shard(aligned)
    return Replicate()


def attention_rule(node: fx.Node, prop):
    """SDPA on CPU (forward and backward): DTensor's strategy (:func:`_attention_strategy`) places
    query/key/value; the keyword-only ``attn_mask`` is placed here, because DTensor redistributes
    positional arguments only (torch 2.13, ``ShardingPropagator.propagate_op_sharding_non_cached``)
    and would leave the mask as it comes (a mask built from global sizes, as
    ``torch.compile(backend="spmd")`` graphs have, would reach the kernel unsplit). On each mesh dim
    the mask follows the query's ``Shard`` where it spans that dim, and is replicated elsewhere.
    """
    if rng.is_random(node.target):
        drawn = random_rule(node, prop)
        if drawn is not None:
            return drawn
    sharding = prop.dtensor_rule(node)
    mask = node.kwargs.get("attn_mask")
    if not isinstance(mask, fx.Node) or not isinstance(prop.output_of(mask), DTensorSpec):
        return sharding
    leaves, _ = pytree.tree_flatten((node.args, {**node.kwargs, "attn_mask": _MASK_SLOT}))
    slot = next(i for i, leaf in enumerate(leaves) if leaf is _MASK_SLOT)
    query_index = 1 if node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default else 0
    query = sharding.inputs[query_index]
    mask_spec = prop.output_of(mask)
    placements = tuple(
        _mask_placement(mask_spec.tensor_meta.shape, query.tensor_meta.shape, p.dim) if isinstance(p, Shard) else Replicate()
        for p in query.placements
    )
    inputs = list(sharding.inputs)
    inputs[slot] = spec_with_meta(prop.mesh, placements, mask_spec.tensor_meta)
    return dataclasses.replace(sharding, inputs=tuple(inputs))


_MASK_SLOT = object()


def _attention_strategy(num_outputs: int):
    """DTensor op strategy for SDPA-on-CPU forward (2 outputs) or backward (3 outputs)."""
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    def strategy(op_schema):
        tensors = [a for a in op_schema.args_schema if isinstance(a, OpStrategy)]
        mask = op_schema.kwargs_schema.get("attn_mask")
        count = num_outputs + len(tensors) + (1 if isinstance(mask, OpStrategy) else 0)
        candidates = [[Replicate()] * count]
        query_shape = tensors[1 if num_outputs == 3 else 0].shape
        for dim in (0, 1):  # batch dim (data parallel), head dim (tensor parallel)
            placements = [Shard(dim)] * (num_outputs + len(tensors))
            if isinstance(mask, OpStrategy):
                placements.append(_mask_placement(mask.shape, query_shape, dim))
            candidates.append(placements)
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, candidates, input_index=num_outputs
        )

    return strategy


def _fused_optimizer_rule(num_lists: int):
    """Element i of each of the first ``num_lists`` tensor lists follows parameter i's placements (a
    scalar state such as a step count, of another shape, is replicated)."""

    def rule(node: fx.Node, prop):
        params = node.args[0]
        param_specs = [prop.output_of(p) for p in params]
        replicate = tuple(Replicate() for _ in range(prop.mesh.ndim))

        def following(i: int, a: fx.Node):
            spec = prop.output_of(a)
            same_shape = tuple(spec.tensor_meta.shape) == tuple(param_specs[i].tensor_meta.shape)
            return spec_with_meta(prop.mesh, param_specs[i].placements if same_shape else replicate, spec.tensor_meta)

        wanted = []
        for arg in node.args:
            if isinstance(arg, (list, tuple)):
                wanted.extend(following(i, a) for i, a in enumerate(arg))
            elif isinstance(arg, fx.Node):
                wanted.append(prop.output_of(arg))
            else:
                wanted.append(None)
        for v in node.kwargs.values():
            if isinstance(v, fx.Node):
                wanted.append(prop.output_of(v))
        outputs = tuple([following(i, a) for i, a in enumerate(node.args[k])] for k in range(num_lists))
        return NodeSharding(inputs=tuple(wanted), output=outputs)

    return rule


def random_rule(node: fx.Node, prop):
    """Placements of a random op, expanded as a global draw (see :mod:`spmd_expand.rng`).

    Returns None (DTensor's rule) when the op's arguments switch the draw off.

    Raises:
        UnsupportedOpError: the op hands its random state to another op (fused attention with dropout).
    """
    random_op = rng.classify(node)
    if random_op is None:
        return None
    leaves, _ = pytree.tree_flatten((node.args, node.kwargs))
    specs = [prop.output_of(a) if isinstance(a, fx.Node) else None for a in leaves]
    specs = [s if isinstance(s, DTensorSpec) else None for s in specs]
    if random_op.kind == "unsupported":
        raise node_error(
            UnsupportedOpError,
            node,
            f"random op cannot be split across ranks exactly: {random_op.reason}",
            placements=[s.placements for s in specs if s is not None],
            fix=random_op.fix,
        )
    vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
    gathered = [spec_with_meta(prop.mesh, replicate(prop.mesh), s.tensor_meta) if s is not None else None for s in specs]

    if random_op.kind == "sizes":
        size = rng.bound_args(node)[random_op.size_arg]
        # A permutation (randperm(n)) holds indices into all n rows: no rank's slice of it is "its
        # rows", so it stays whole; a tensor drawn at a sharded batch size is split like the batch.
        sizes = [_sym(prop, s) for s in size] if isinstance(size, (list, tuple)) else []
        placements = _sharded_placements(prop, sizes) or replicate(prop.mesh)
        return NodeSharding(inputs=(), output=_out_spec(prop, node, placements), random=random_op)
    if random_op.kind == "dropout":
        x = specs[0]
        value, mask = rng.dropout_placements(x.placements)
        inputs = [spec_with_meta(prop.mesh, value, x.tensor_meta)] + [None] * (len(leaves) - 1)
        output = (tensor_spec(prop.mesh, value, vals[0]), tensor_spec(prop.mesh, mask, vals[1]))
        return NodeSharding(inputs=tuple(inputs), output=output, random=random_op)
    if random_op.kind == "like":
        ref = specs[0]
        inputs = [None if i in random_op.carriers else g for i, g in enumerate(gathered)]
    else:  # "values": the draw reads its inputs
        ref = next((s for s in specs if s is not None), None)
        inputs = gathered

    def placements(v):
        return rng.keep_shards(ref.placements, ref.tensor_meta.shape, v.shape) if ref is not None else replicate(prop.mesh)

    outputs = [tensor_spec(prop.mesh, placements(v), v) if isinstance(v, torch.Tensor) else None for v in vals]
    output = outputs[0] if not isinstance(node.meta["val"], (tuple, list)) else type(node.meta["val"])(outputs)
    return NodeSharding(inputs=tuple(inputs), output=output, random=random_op)


def _register_dtensor_strategies() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops import _pointwise_ops

    prop = DTensor._op_dispatcher.sharding_propagator
    for op, outputs in (
        (aten._scaled_dot_product_flash_attention_for_cpu.default, 2),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 3),
    ):
        if op not in prop.op_strategy_funcs:
            prop.register_op_strategy(op, _attention_strategy(outputs))
    # copy_'s strategy (self and src alike; any partial kept) for the foreach copies, which torch 2.13
    # registers nothing for, in DTensor's own way (a list op's strategy applies element by element).
    for op in (aten._foreach_copy_.default, aten._foreach_copy.default):
        if op not in prop.op_single_dim_strategy_funcs and op not in prop.op_strategy_funcs:
            _pointwise_ops._register_single_dim_pointwise(op, _pointwise_ops._ALL_PARTIAL_BINARY_PRESERVING_RULES)


def _registered_with_dtensor(target: Any) -> bool:
    """Whether DTensor's propagator has a rule for ``target`` (e.g. the user's ``register_sharding``)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    return any(target in table for table in (propagator.op_strategy_funcs, propagator.op_single_dim_strategy_funcs, propagator.op_to_rules))


def _register_functional_twins() -> None:
    """Give functional ops the DTensor strategy of their in-place twin where they have none."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    tables = (
        (prop.op_strategy_funcs, prop.op_to_schema_info, prop.register_op_strategy),
        (prop.op_single_dim_strategy_funcs, prop.op_to_schema_info_for_single_dim_strategy, prop.register_single_dim_op_strategy),
    )
    for strategies, infos, register in tables:
        for inplace in list(strategies):
            name = inplace._schema.name.split("::")[-1]
            if not name.endswith("_") or name.endswith("__"):
                continue
            packet = getattr(aten, name[:-1], None)
            functional = getattr(packet, inplace._overloadname, None) if packet is not None else None
            if functional is not None and not _registered_with_dtensor(functional):
                register(functional, strategies[inplace], infos.get(inplace))


_register_functional_twins()
_register_dtensor_strategies()


_RULES: dict[Any, Callable] = {
    GRADIENT: gradient_rule,
    UNSHARD: unshard_rule,
    LAYOUT: layout_rule,
    SEQUENCE_FIRST: sequence_first_rule,
    aten._fused_adam.default: _fused_optimizer_rule(5),
    aten._fused_adamw.default: _fused_optimizer_rule(5),
    aten._fused_sgd.default: _fused_optimizer_rule(3),
    aten._fused_adam.tensor_lr: _fused_optimizer_rule(5),
    aten._fused_adamw.tensor_lr: _fused_optimizer_rule(5),
    aten._fused_sgd.tensor_lr: _fused_optimizer_rule(3),
    aten._fused_adagrad.default: _fused_optimizer_rule(4),
    aten._fused_adagrad.tensor_lr: _fused_optimizer_rule(3),
    aten.lift_fresh_copy.default: constant_rule,
    aten._scaled_dot_product_flash_attention_for_cpu.default: attention_rule,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention_rule,
}
_RULES.update({op: factory_rule for op in FACTORY_OPS})
_RULES.update({aten.split.Tensor: split_rule, aten.split_with_sizes.default: split_rule, aten.unbind.int: unbind_rule})
_RULES[aten.select.int] = select_rule
_RULES.update(loss_parallel.RULES)
_RULES[aten.cat.default] = cat_rule
_RULES.update({aten._assert_async.default: assert_rule, aten._assert_async.msg: assert_rule})
_RULES.update({op: sharded_size_rule for op in NEW_FACTORY_OPS | {aten.expand.default, aten.repeat.default}})


def _named_tensor_args(node: fx.Node, names: tuple[str, ...]) -> Optional[list[tuple[str, fx.Node]]]:
    """(schema name, node) of each tensor leaf of ``node``'s args and kwargs, in pytree leaf order;
    None if an argument is not a node."""
    named = list(zip(names, node.args)) + list(node.kwargs.items())
    if len(named) != len(names) or not all(isinstance(a, fx.Node) for _, a in named):
        return None
    return named


def grouped_mm_rule(node: fx.Node, prop) -> Optional[NodeSharding]:
    """transformers' ``grouped_mm_fallback(input, weight, offs)`` and its backward, on rows split
    over data-parallel ranks.

    ``input`` (S, K) holds the routed token rows sorted by expert, ``weight`` (E, K, N) one matrix per
    expert and ``offs`` (E,) the cumulative row count per expert, so rows ``offs[e-1]:offs[e]`` are
    multiplied by ``weight[e]``. Over each mesh dim where ``input`` is split on rows (``Shard(0)``, as
    the experts' sort-and-gather leaves it under DDP/FSDP/HSDP) the rows stay split, and each rank
    multiplies its own: its global rows ``start:start + rows`` take the offsets
    ``clamp(offs - start, 0, rows)``. Any other placement of ``input`` (a ``_StridedShard``, whose rows
    are no contiguous range; ``Shard(1)``, e.g. hidden features split over a TP dim; ``Partial``), and
    every placement of ``weight`` and ``offs``, is redistributed to ``Replicate()``: always correct,
    though an expert- or tensor-parallel layout of the experts is gathered, not kept. The output is
    split like the rows; in the backward, ``grad_input`` too, and ``grad_weight`` is partial (a sum over
    the ranks' rows) over the split dims. With no split dim every rank runs the op as is.
    """
    backward = "backward" in str(node.target)
    names = ("input", "weight", "offs", "grad_output") if backward else ("input", "weight", "offs")
    named = _named_tensor_args(node, names)
    if named is None:
        return None
    args = dict(named)
    rows_spec, weight_spec = prop.output_of(args["input"]), prop.output_of(args["weight"])
    mesh = prop.mesh
    rows_placements = tuple(p if type(p) is Shard and p.dim == 0 else Replicate() for p in rows_spec.placements)
    split = [i for i, p in enumerate(rows_placements) if not p.is_replicate()]
    rows_wanted = spec_with_meta(mesh, rows_placements, rows_spec.tensor_meta)
    wanted = {
        "input": rows_wanted,
        "weight": spec_with_meta(mesh, replicate(mesh), weight_spec.tensor_meta),
        "offs": spec_with_meta(mesh, replicate(mesh), prop.output_of(args["offs"]).tensor_meta),
    }
    if backward:
        grad_spec = prop.output_of(args["grad_output"])
        wanted["grad_output"] = spec_with_meta(mesh, rows_placements, grad_spec.tensor_meta)
    op = node.target
    # This rank's rows (ints, computed here: DTensor computes them with tensor ops, which the local
    # op's trace would record).
    start, rows = local_offset(rows_wanted)[0], local_shape(rows_wanted)[0]

    def local(*tensors: torch.Tensor) -> Any:
        values = dict(zip((name for name, _ in named), tensors))
        values["offs"] = (values["offs"] - start).clamp(0, rows)
        return op(*(values[name] for name in names))

    vals = node.meta["val"]
    if backward:
        partial = tuple(Partial() if i in split else Replicate() for i in range(mesh.ndim))
        output: Any = (
            spec_with_meta(mesh, rows_placements, tensor_meta(vals[0])),
            spec_with_meta(mesh, partial, tensor_meta(vals[1])),
        )
    else:
        output = spec_with_meta(mesh, rows_placements, tensor_meta(vals))
    # All replicated: every rank runs the op as is.
    return NodeSharding(inputs=tuple(wanted[name] for name, _ in named), output=output, local_op=local if split else None)


# Rules for ops of other libraries, by name (the op exists only once the library is imported).
_RULES_BY_NAME: dict[str, Callable] = {
    "transformers.grouped_mm_fallback.default": grouped_mm_rule,
    "transformers.grouped_mm_fallback_backward.default": grouped_mm_rule,
}


# Pooling backward ops DTensor (torch 2.13) places only in part (it has max_pool2d's and
# adaptive_avg_pool2d's backward, not these). Pooling acts on each sample and channel alone, so
# grad_output, the input, the indices and grad_input may all be split on the batch dim, or all on
# the channel dim (batched inputs), or all replicated; registered with DTensor's own API.
_POOL_BACKWARD = [
    aten.avg_pool2d_backward.default,
    aten.avg_pool3d_backward.default,
    aten._adaptive_avg_pool3d_backward.default,
    aten.adaptive_max_pool2d_backward.default,
    aten.adaptive_max_pool3d_backward.default,
    aten.max_pool3d_with_indices_backward.default,
    aten.fractional_max_pool2d_backward.default,
    aten.fractional_max_pool3d_backward.default,
]


def _is_tensor(arg: Any) -> bool:
    """Whether an argument ``register_sharding`` hands a strategy function stands for a tensor."""
    return isinstance(arg, DTensorSpec) or hasattr(arg, "shape")


@register_sharding(_POOL_BACKWARD)
def _pool_backward_sharding(grad_output, input, *args):
    tensor_args = [_is_tensor(a) for a in args]
    strategies = []
    for placement in [Replicate(), Shard(0)] + ([Shard(1)] if len(input.shape) >= 4 else []):
        others = [placement if is_tensor else None for is_tensor in tensor_args]
        strategies.append(([placement], [placement, placement, *others]))
    return strategies


# Reflection and replication padding (``nn.ReflectionPad1d/2d/3d``, ``nn.ReplicationPad1d/2d/3d``,
# ``F.pad(mode="reflect" | "replicate")``) and their backward ops, which DTensor has no rule for (torch
# 2.13; the replication backward ops have no decomposition either, and under
# ``torch.compile(backend="spmd")`` Dynamo runs DTensor's rules, not decompositions). The padded dims
# are the last ``len(padding) // 2``; every dim before them (batch, channels) may be split, all
# tensors alike; or all replicated. The fused kernels stay in the graph.
_PADDING = [getattr(aten, f"{mode}_pad{d}d").default for mode in ("reflection", "replication") for d in (1, 2, 3)]
_PADDING_BACKWARD = [getattr(aten, f"{mode}_pad{d}d_backward").default for mode in ("reflection", "replication") for d in (1, 2, 3)]


def _unpadded_placements(input, padding) -> list:
    return [Replicate(), *(Shard(d) for d in range(len(input.shape) - len(padding) // 2))]


@register_sharding(_PADDING)
def _padding_sharding(input, padding):
    return [([p], [p, None]) for p in _unpadded_placements(input, padding)]


@register_sharding(_PADDING_BACKWARD)
def _padding_backward_sharding(grad_output, input, padding):
    return [([p], [p, p, None]) for p in _unpadded_placements(input, padding)]


# ``torch.cdist`` for fewer than 25 rows a side (beyond that, or with compute_mode asking for it, torch
# computes it as ``_euclidean_dist``, which decomposes into matmuls): ``_cdist_forward(x1, x2, p, mode)``
# of ``(*batch, P, M)`` and ``(*batch, R, M)`` is ``(*batch, P, R)``, one distance per row pair, so it
# splits on a batch dim (all alike), on x1's rows (x2 replicated) or on x2's rows (x1 replicated). Its
# backward ``_cdist_backward(grad, x1, x2, p, cdist)`` is x1's gradient (autograd calls it with the
# inputs swapped for x2's): split the same ways, where split on x2's rows each rank sums its rows'
# contributions (partial). Inputs of different ranks (broadcast batch dims): replicated only.
@register_sharding(aten._cdist_forward.default)
def _cdist_sharding(x1, x2, p, compute_mode):
    strategies = [([Replicate()], [Replicate(), Replicate(), None, None])]
    if len(x1.shape) == len(x2.shape):
        rows = len(x1.shape) - 2
        strategies += [([Shard(d)], [Shard(d), Shard(d), None, None]) for d in range(rows)]
        strategies += [([Shard(rows)], [Shard(rows), Replicate(), None, None])]
        strategies += [([Shard(rows + 1)], [Replicate(), Shard(rows), None, None])]
    return strategies


@register_sharding(aten._cdist_backward.default)
def _cdist_backward_sharding(grad, x1, x2, p, cdist):
    strategies = [([Replicate()], [Replicate(), Replicate(), Replicate(), None, Replicate()])]
    if len(x1.shape) == len(x2.shape):
        rows = len(x1.shape) - 2
        strategies += [([Shard(d)], [Shard(d), Shard(d), Shard(d), None, Shard(d)]) for d in range(rows)]
        strategies += [([Shard(rows)], [Shard(rows), Shard(rows), Replicate(), None, Shard(rows)])]
        strategies += [([Partial()], [Shard(rows + 1), Replicate(), Shard(rows), None, Shard(rows + 1)])]
    return strategies


# ``fill`` (``t.fill_(v)``, and ``t[..., 0] = v``, which runs ``fill_.Tensor`` with ``v`` as a 0-d
# tensor: HuggingFace T5's ``_shift_right`` does this to the labels). Every element becomes ``v``:
# ``t`` keeps a ``Shard`` or ``Replicate`` placement. A ``Partial(sum)`` tensor stays partial only when
# ``v`` is a literal 0 (W ranks' zeros sum to 0); filled with anything else it would sum to W times
# ``v``, which DTensor's own rule for ``fill_.Scalar`` (torch 2.13) returns, so this replaces it: the
# tensor is reduced first, or, in place, DTensor refuses the fill with its own error. DTensor had no
# rule for ``fill_.Tensor`` (eager DTensors failed, and Dynamo broke the graph there).
_FILL = [aten.fill_.Scalar, aten.fill.Scalar, aten.fill_.Tensor, aten.fill.Tensor]


@register_sharding(_FILL)
def _fill_sharding(self, value):
    value_placement = Replicate() if _is_tensor(value) else None
    placements = [Replicate(), *(Shard(d) for d in range(len(self.shape)))]
    # A literal 0 only: a symbolic value (a hyperparameter input) may be 0 in one call and not the next.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        placements.append(Partial())
    return [([p], [p, value_placement]) for p in placements]


# ``_weight_norm_interface_backward(grad_w, v, g, norms, dim)`` -> ``(grad_v, grad_g)``, the backward of
# ``torch.nn.utils.parametrizations.weight_norm`` (its forward DTensor places through torch's
# decomposition; the backward has neither a strategy nor a decomposition in torch 2.13). Linear in
# ``grad_w``: a partial ``grad_w`` (data-parallel gradient before its reduction) with the rest
# replicated gives partial gradients; every slice along ``dim`` is normalized alone, so everything may
# be split along ``dim`` (not when ``dim`` is -1: one norm over the whole tensor); or all replicated.
@register_sharding(aten._weight_norm_interface_backward.default)
def _weight_norm_backward_sharding(grad_w, v, g, norms, dim):
    strategies = [
        ([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), Replicate(), None]),
        ([Partial(), Partial()], [Partial(), Replicate(), Replicate(), Replicate(), None]),
    ]
    if dim != -1:
        d = dim % len(v.shape)
        strategies.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), Shard(d), None]))
    return strategies


# ``unfold(self, dimension, size, step)`` (``Tensor.unfold``: windows along ``dimension``, a new last dim
# of ``size``; patch extraction) and its backward ``unfold_backward(grad, input_sizes, dim, size, step)``
# (the windows summed back): each slice across the other dims is windowed alone, so a split on any
# other dim stays where it is (the new last dim is not split); both are linear, so a partial value stays
# partial; or all replicated. A split on ``dimension`` itself has no strategy: DTensor gathers it.
def _window_strategies(ndim: int, dim: int, others: int) -> list:
    d = dim % ndim
    placements = [Replicate(), Partial()] + [Shard(k) for k in range(ndim) if k != d]
    return [([p], [p] + [None] * others) for p in placements]


@register_sharding(aten.unfold.default)
def _unfold_sharding(self, dimension, size, step):
    return _window_strategies(len(self.shape), dimension, 3)


@register_sharding(aten.unfold_backward.default)
def _unfold_backward_sharding(grad, input_sizes, dim, size, step):
    return _window_strategies(len(input_sizes), dim, 4)


# ``embedding_renorm_(weight, indices, max_norm, norm_type)``: rescales, in place, the rows of the
# weight that ``indices`` name. The rows are picked by global indices, so the weight and the indices
# are both replicated: every rank renorms every row the global batch reads, as one device does (a
# sharded weight is gathered for it and written back to its shards). Called on the parameter itself;
# ``nn.Embedding(max_norm=...)``, which calls it on the value F.embedding is handed, is refused by
# ``trace._refuse_writes_to_parameter_reads``.
@register_sharding([aten.embedding_renorm_.default, aten.embedding_renorm.default])
def _embedding_renorm_sharding(weight, indices, max_norm, norm_type):
    return [([Replicate()], [Replicate(), Replicate(), None, None])]


# ``embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)``:
# DTensor's rule (torch 2.13, ``_embedding_ops.embedding_dense_backward_strategy``) offers, besides
# column-wise (grad_output split on the embedding dim, indices replicated) and partial grad_output,
# grad_output and indices split on the same batch dim with a partial weight gradient. That one is wrong
# under ``scale_grad_by_freq=True`` (``nn.Embedding(..., scale_grad_by_freq=True)``): each row's
# gradient is divided by how often its index occurs in the *whole* batch, and a rank counts only its
# own part, so data-parallel gradients came out larger than one device's, silently. DTensor's rule is
# kept and filtered: when frequencies are counted, strategies that split the indices are dropped, so
# the indices are replicated (gathered) and every rank counts the global batch as one device does.
# (``scale_grad_by_freq`` is in the rule's cache key: its schema info keeps arguments from index 2.)
def _counting_global_frequencies(strategies_of: Callable) -> Callable:
    def strategies(op, args_schema, kwargs_schema):
        found = strategies_of(op, args_schema, kwargs_schema)
        if not args_schema[4]:
            return found
        return [s for s in found if not isinstance(s[2], Shard)]  # [weight grad, grad_output, indices]

    return strategies


def _filter_embedding_backward_rule() -> None:
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    info = table[aten.embedding_dense_backward.default]
    table[aten.embedding_dense_backward.default] = dataclasses.replace(info, func=_counting_global_frequencies(info.func))


_filter_embedding_backward_rule()


def constant_rule_for_untensored(node: fx.Node, prop):
    """An op with no tensor argument that has no rule of its own (``linspace``, ``logspace``,
    ``tril_indices``, window functions): every rank computes the same value from the same global
    arguments (a batch size is passed as its global value), so the output is replicated."""
    replicated = tuple(Replicate() for _ in range(prop.mesh.ndim))
    val = node.meta["val"]
    if isinstance(val, (list, tuple)):
        return NodeSharding(inputs=(), output=[tensor_spec(prop.mesh, replicated, v) for v in val])
    return NodeSharding(inputs=(), output=tensor_spec(prop.mesh, replicated, val))


def _takes_no_tensor(target: Any) -> bool:
    """An ATen op none of whose arguments is a tensor (or a list of them), returning tensors."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return (
        not any("Tensor" in str(a.type) for a in schema.arguments)
        and bool(schema.returns)
        and all("Tensor" in str(r.type) for r in schema.returns)
    )


def lookup(target: Any) -> Optional[Callable]:
    """The spmd_expand rule for ``target``, or None where DTensor's own rule applies. A rule for
    another library's op (:data:`_RULES_BY_NAME`) yields to one the user registered with DTensor."""
    rule = _RULES.get(target)
    if rule is None and str(target) in _RULES_BY_NAME and not _registered_with_dtensor(target):
        rule = _RULES_BY_NAME[str(target)]
    if rule is None and rng.is_random(target):
        return random_rule
    if rule is None and _takes_no_tensor(target):
        return constant_rule_for_untensored
    return rule
