"""Random ops: every rank gets exactly its part of what one device would draw.

The promise fixes every random value: element ``i`` of a random tensor must be the value the
single-device step draws for element ``i`` of the global batch. spmd_expand keeps it with a
**global draw**: each rank runs the random op on the *global* shape, from the same generator state
the single device has at that point, and keeps the part its output placement names
(``Replicate``: all of it; ``Shard``: a slice; never any communication for the draw itself). Hence

* values: exact, on every placement (data-parallel ranks get their rows of the single-device
  tensor; tensor-parallel ranks agree on replicated values and hold slices of sharded ones);
* generator: it advances on every rank exactly as on one device (same op, same global size, same
  order), so the next random op, the next step and the user's own draws after the step all see the
  single-device state, on every rank. The user seeds every rank alike (``torch.manual_seed(s)``;
  checked across ranks when the step is compiled and on every call, :func:`generator_state`);
* cost: per random op, each rank generates ``W`` times its share of numbers and holds one global
  random tensor until its slice is copied out.

Why not draw only the local part? On CPU the default generator is mt19937, which has no cheap skip
ahead, and ATen's CPU kernels consume it per element in a layout-dependent order (a ``bernoulli_``
into a transposed tensor draws differently from a contiguous one), so a shard's values cannot be
drawn alone. On CUDA the generator is Philox, counter based, and DTensor's ``OffsetBasedRNGTracker``
(torch/distributed/tensor/_random.py) gives each shard its own offset range: shards get independent
values and the generator stays in sync, but not the single-device values, because a CUDA kernel maps
elements to Philox (subsequence, offset) by thread index, with a grid sized from the tensor's numel
and the device. Matching that for a slice would need a kernel of our own; the global draw is exact
on both device types with torch's kernels.

How each random op (``torch.Tag.nondeterministic_seeded``) is handled (:func:`classify`):

* ``sizes`` (``rand``, ``randn``, ``randint``, ``randperm``, ``normal(float, float, size)``): drawn at
  the global size; a size read from the batch (a sharded :class:`~spmd_expand.dsymint.DSymInt`) makes
  that dim ``Shard``.
* ``like`` (``rand_like``, ``randn_like``, ``randint_like``, ``bernoulli(x, p)``, and the functional
  forms of the in-place fills ``uniform_``, ``normal_``, ``exponential_``, ``geometric_``,
  ``log_normal_``, ``cauchy_``, ``random_``, ``bernoulli_``): the tensor argument is only a *shape
  carrier* (often an ``empty_like`` of an activation). Its values are never read, so it is never
  gathered: expansion draws into a fresh uninitialized tensor with the carrier's global shape and
  strides (strides matter: they decide the order in which CPU kernels fill elements). The output
  keeps the carrier's ``Shard`` placements.
* ``dropout`` (``native_dropout``, what ``F.dropout`` and ``nn.Dropout`` trace to): the mask depends
  only on the input's shape and strides, so it is drawn globally on a carrier and sliced, and the
  output is ``native_dropout_backward(input, mask, scale)``, i.e. ``input * mask * scale``, the same
  arithmetic ``native_dropout`` does, on the local input: activations are never gathered.
* ``values`` (``bernoulli(probs)``, ``normal(mean, std)``, ``poisson``, ``multinomial``, ``binomial``,
  ``rrelu``, ...): the draw reads its inputs' values, so they are brought to ``Replicate`` (gathered),
  drawn globally and sliced: exact, at the cost of that gather.
* ``unsupported`` (raise :class:`~spmd_expand.errors.UnsupportedOpError`): ops that hand their
  random state to another op (fused attention kernels with ``dropout_p > 0`` return a Philox seed
  and offset from which their backward re-draws the mask, cuDNN RNNs keep a dropout state), whose
  backward would re-draw from local shapes; and draws from an explicit ``generator=``, which the
  traced graph holds as a private copy taken at trace time.

Ops whose draw is switched off by their arguments (``dropout_p=0``, ``train=False``) are ordinary
deterministic ops and keep DTensor's rules.
"""

from __future__ import annotations

import operator
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .spec import NodeSharding, local_offset, local_shape, replicate, spec_with_meta

__all__ = ["GENERATOR_FIX", "RandomOp", "bound_args", "classify", "is_random", "draws_random", "generator_state", "emit_global_draw", "dropout_placements", "keep_shards"]

aten = torch.ops.aten

# Ops whose first argument (``self``) gives only the shape, dtype and strides of the draw.
_SHAPE_CARRIER_PACKETS = frozenset(
    {
        aten.rand_like,
        aten.randn_like,
        aten.randint_like,
        aten.uniform,
        aten.normal_functional,
        aten.exponential,
        aten.geometric,
        aten.log_normal,
        aten.cauchy,
        aten.random,
    }
)
_SHAPE_CARRIER_OPS = frozenset({aten.bernoulli.p, aten.bernoulli.Tensor})

# Arguments and results that carry random state from one op to another (fused attention, cuDNN RNN).
_RNG_STATE_NAMES = ("philox", "rng_state", "dropout_state", "dropout_mask")


@dataclass(frozen=True)
class RandomOp:
    """How one random node is placed and expanded.

    ``kind``: ``"sizes"``, ``"like"``, ``"dropout"``, ``"values"`` or ``"unsupported"`` (see the module
    docstring). ``carriers``: indices into ``pytree.tree_flatten((node.args, node.kwargs))`` of the
    arguments that only give a shape. ``size_arg``: for ``"sizes"``, the schema name of the size
    argument. ``reason`` and ``fix``: for ``"unsupported"``, why, and what the user can do instead.
    """

    kind: str
    carriers: frozenset = frozenset()
    size_arg: Optional[str] = None
    reason: str = ""
    fix: str = ""


def is_random(target: Any) -> bool:
    """Whether ``target`` is an ATen op that may draw from a random generator."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def bound_args(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (defaults filled in)."""
    schema = node.target._schema
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if arg.kwarg_only or i >= len(node.args):
            if arg.name in node.kwargs:
                bound[arg.name] = node.kwargs[arg.name]
            elif arg.has_default_value():
                bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = node.args[i]
    return bound


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a generator when it runs: a random op whose draw its arguments do
    not switch off (``dropout_p=0`` / ``dropout=0`` for fused attention and RNNs, ``train=False``)."""
    if node.op != "call_function" or not is_random(node.target):
        return False
    args = bound_args(node)
    for name in ("dropout_p", "dropout"):
        if isinstance(args.get(name), (int, float)) and args[name] == 0:
            return False
    return not any(args.get(name) is False for name in ("train", "training"))


def classify(node: fx.Node) -> Optional[RandomOp]:
    """The :class:`RandomOp` of ``node``, or None when it draws nothing (see :func:`draws_random`)."""
    if not draws_random(node):
        return None
    op = node.target
    schema = op._schema
    names = [a.name for a in schema.arguments] + [r.name or "" for r in schema.returns]
    if any(key in name for name in names for key in _RNG_STATE_NAMES):
        return RandomOp(
            "unsupported",
            reason=f"{op} hands its random state to another op (its backward re-draws the dropout mask "
            "from it), which would re-draw from this rank's local shapes instead of the global ones",
            fix="run attention on SDPA's math kernel (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)), whose "
            "dropout is an ordinary dropout op, or use dropout_p=0 and apply dropout outside the kernel",
        )
    if isinstance(bound_args(node).get("generator"), fx.Node):
        return RandomOp(
            "unsupported",
            reason=f"{op} draws from an explicit torch.Generator; the traced graph keeps a private copy of "
            "its state, so the step would neither advance your generator nor draw what one device draws "
            "after a recompile",
            fix="draw from the default generator (leave out generator=) and seed it alike on every rank "
            "with torch.manual_seed",
        )
    if schema.is_mutable:
        return RandomOp(
            "unsupported",
            reason=f"{op} is an in-place random op left in the graph after functionalization",
            fix="report this graph; an out-of-place form of the op (e.g. torch.rand_like) avoids it",
        )
    if op is aten.native_dropout.default:
        return RandomOp("dropout", carriers=frozenset({0}))
    if op.overloadpacket in _SHAPE_CARRIER_PACKETS or op in _SHAPE_CARRIER_OPS:
        return RandomOp("like", carriers=frozenset({0}))
    if not any("Tensor" in str(a.type) for a in schema.arguments):
        size_arg = "size" if any(a.name == "size" for a in schema.arguments) else "n"
        return RandomOp("sizes", size_arg=size_arg)
    return RandomOp("values")


GENERATOR_FIX = (
    "seed every rank alike (torch.manual_seed(seed) on each rank, not seed + rank) and make the same "
    "draws from torch's default generator on every rank between calls; draw rank-specific randomness "
    "(data augmentation in the main process, a rank's own sampling) from a torch.Generator of its own"
)
"""What to do when ranks' default generators differ at the start of a step that draws random numbers."""


def generator_state(device_type: str) -> str:
    """The default generator of ``device_type`` (the one the step's random ops draw from), as a short
    rank-comparable text: its initial seed (``torch.initial_seed()``) and a CRC-32 of its state.
    About 3 us on CPU (mt19937: 5,056 bytes); no device synchronization on CUDA (Philox seed and
    offset live on the host)."""
    if device_type == "cpu":
        state, seed = torch.get_rng_state(), torch.initial_seed()
    else:
        module = torch.get_device_module(device_type)
        state, seed = module.get_rng_state(), module.initial_seed()
    return f"seed {seed}, state crc32 {zlib.crc32(state.numpy())}"


def keep_shards(placements, ref_shape, out_shape) -> tuple:
    """``placements`` of a reference tensor carried to a random output: each ``Shard(d)`` stays where
    the output has dim ``d`` with the same global size; anything else (``Partial``, strided shards,
    dims that change size) becomes ``Replicate``. Any choice is exact (the draw is global and each
    rank slices it); this one matches what the consumers of the output usually hold."""
    kept = []
    for p in placements:
        same_dim = type(p) is Shard and p.dim < len(out_shape) and p.dim < len(ref_shape) and out_shape[p.dim] == ref_shape[p.dim]
        kept.append(p if same_dim else Replicate())
    return tuple(kept)


def dropout_placements(placements) -> tuple[tuple, tuple]:
    """(input/output placements, mask placements) for ``native_dropout`` of an input placed so.

    ``output = input * mask * scale`` is linear in the input, so a ``Shard`` or a plain
    ``Partial(sum/avg)`` input keeps its placement; anything else is gathered first. The mask is the
    same on every rank that holds the same elements: ``Shard`` stays, ``Partial`` becomes ``Replicate``.
    """
    value = tuple(
        p if type(p) in (Shard, Replicate) or (type(p) is Partial and p.reduce_op in ("sum", "avg")) else Replicate()
        for p in placements
    )
    mask = tuple(Replicate() if isinstance(p, Partial) else p for p in value)
    return value, mask


def _copy_meta(new: fx.Node, node: fx.Node, output: Any) -> fx.Node:
    new.meta["spmd"] = NodeSharding(output=output)
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    if "custom" in node.meta:
        new.meta["custom"] = node.meta["custom"]
    return new


def _global_spec(spec: DTensorSpec) -> DTensorSpec:
    return spec_with_meta(spec.mesh, replicate(spec.mesh), spec.tensor_meta)


def _local_part(graph: fx.Graph, node: fx.Node, value: fx.Node, spec: DTensorSpec) -> fx.Node:
    """This rank's part of the global tensor ``value`` under ``spec``: slices along sharded dims,
    copied out so the global random tensor is freed right away (a saved dropout mask would
    otherwise keep it alive until backward)."""
    shape, offset, full = local_shape(spec), local_offset(spec), list(spec.tensor_meta.shape)
    sliced = False
    for d, (n, o, g) in enumerate(zip(shape, offset, full)):
        if n != g:
            value = _copy_meta(graph.call_function(aten.slice.Tensor, (value, d, o, o + n)), node, spec)
            sliced = True
    if not sliced:
        return value
    copy = graph.call_function(aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    return _copy_meta(copy, node, spec)


def _carrier(graph: fx.Graph, node: fx.Node, leaf: fx.Node, spec: DTensorSpec) -> fx.Node:
    """An uninitialized tensor with the global shape, strides, dtype and device of ``leaf``."""
    meta = spec.tensor_meta
    empty = graph.call_function(
        aten.empty_strided.default,
        (list(meta.shape), list(meta.stride)),
        {"dtype": meta.dtype, "device": leaf.meta["val"].device},
    )
    return _copy_meta(empty, node, _global_spec(spec))


def emit_global_draw(
    graph: fx.Graph,
    node: fx.Node,
    sharding: NodeSharding,
    random_op: RandomOp,
    input_specs: Callable[[fx.Node], DTensorSpec],
    local_value: Callable[[fx.Node, Optional[DTensorSpec]], Any],
) -> Any:
    """Emit into ``graph`` (this rank's local graph) the global draw of random ``node`` and this
    rank's part of it.

    Args:
        sharding: the node's placements (``sharding.output``: what this rank keeps;
            ``sharding.inputs``: per flattened argument, the placement a value input is brought to).
        input_specs: global graph node -> its propagated output spec (the carrier's global meta).
        local_value: (input node, wanted spec) -> this rank's value of that input with that placement
            (redistributed as needed); sizes (DSymInts) as their global value.

    Returns:
        The local node, or a tuple of local nodes for ops with several outputs.
    """
    leaves, tree = pytree.tree_flatten((node.args, node.kwargs))
    wanted = list(sharding.inputs) + [None] * (len(leaves) - len(sharding.inputs))
    new_leaves = []
    for i, (leaf, spec) in enumerate(zip(leaves, wanted)):
        if not isinstance(leaf, fx.Node):
            new_leaves.append(leaf)
        elif i in random_op.carriers:
            new_leaves.append(_carrier(graph, node, leaf, input_specs(leaf)))
        else:
            new_leaves.append(local_value(leaf, spec))
    args, kwargs = pytree.tree_unflatten(new_leaves, tree)
    outputs = sharding.output
    drawn = _copy_meta(graph.call_function(node.target, tuple(args), kwargs), node, None)

    if random_op.kind == "dropout":
        out_spec, mask_spec = outputs
        drawn.meta["spmd"] = NodeSharding(output=(_global_spec(out_spec), _global_spec(mask_spec)))
        mask = _copy_meta(graph.call_function(operator.getitem, (drawn, 1)), node, _global_spec(mask_spec))
        mask = _local_part(graph, node, mask, mask_spec)
        p = bound_args(node)["p"]
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)  # as native_dropout computes it
        x = local_value(leaves[0], wanted[0])
        out = _copy_meta(graph.call_function(aten.native_dropout_backward.default, (x, mask, scale)), node, out_spec)
        return out, mask

    if isinstance(outputs, DTensorSpec):
        drawn.meta["spmd"] = NodeSharding(output=_global_spec(outputs))
        return _local_part(graph, node, drawn, outputs)
    drawn.meta["spmd"] = NodeSharding(output=type(outputs)(_global_spec(s) if isinstance(s, DTensorSpec) else s for s in outputs))
    parts = []
    for i, spec in enumerate(outputs):
        item = _copy_meta(graph.call_function(operator.getitem, (drawn, i)), node, _global_spec(spec) if isinstance(spec, DTensorSpec) else spec)
        parts.append(_local_part(graph, node, item, spec) if isinstance(spec, DTensorSpec) else item)
    return tuple(parts)

