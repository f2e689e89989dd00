"""Propagate DTensor placements through the global graph, node by node.

Each node gets ``node.meta["spmd"]``, a :class:`NodeSharding`: the placements (as DTensor's
``DTensorSpec``) its tensor inputs must have and the spec of its output. Sizes computed from batch
tensors get a :class:`~spmd_expand.dsymint.DSymInt` instead; floats computed from hyperparameter inputs
(learning rates, ...) get their example value and stay run-time values in the local graph.

Rules are looked up in DTensor's own sharding propagator (``DTensor._op_dispatcher.sharding_propagator``,
the one eager DTensor uses), which also picks the redistribution of inputs an op needs. Where DTensor
offers several strategies, the choice weighs compute per rank as well as communication, and keeps the
batch sharded where that is cheaper (:mod:`spmd_expand.cost`). Only where torch has no rule does
:mod:`spmd_expand.rules` decide.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._ops._math_ops import _NormPartial

from . import rules
from .annotate import VIEW_OPS
from .cost import BatchSymbols, NodeCost, choosing_by_cost
from .dsymint import SYM_ARITHMETIC, SYM_SOURCE_OPS, DSymInt, apply_arithmetic, from_size_node
from .errors import PlacementError, TraceError, UnsupportedOpError, node_error
from .spec import AS_PRODUCED, NodeSharding, concrete, local_shape, replicate, spec_with_meta, tensor_meta, tensor_spec
from .trace import TracedStep, is_runtime_scalar

__all__ = ["propagate"]

aten = torch.ops.aten

# Reshapes: any layout of the input is a valid input (see _Propagator._gathered_view).
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unflatten.int})

# Ops without a rule whose usual caller has a form that has rules: what the error's fix says instead
# of registering a rule.
_FORM_WITH_RULES = {
    op: "nn.EmbeddingBag (F.embedding_bag) is supported over a 2-D (bags, bag_size) input; a 1-D input "
    "with offsets is not (the offsets index the whole flattened batch, which no rank holds): pad the bags "
    "to one size and pass them as a 2-D tensor (padding_idx keeps the padding out of every mode)"
    for op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
}

# Ops through which a partial p-norm stays one (see _Propagator.dtensor_rule): views, copies,
# stack/cat, and the norms themselves.
# Integer dtypes whose sums overflow at sizes a step reaches (a count of 128 rows in int8).
_NARROW_INTEGERS = frozenset({torch.int8, torch.uint8, torch.int16})

_NORM_PARTIAL_SAFE = VIEW_OPS | {
    aten.linalg_vector_norm.default,
    aten._foreach_norm.Scalar,
    aten.stack.default,
    aten.cat.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.squeeze.dims,
    aten.squeeze.default,
}


def _with_meta(out: Any, val: Any, mesh: DeviceMesh) -> Any:
    """Attach global tensor metadata from the traced value to DTensor's output spec(s)."""
    if isinstance(out, DTensorSpec):
        return spec_with_meta(mesh, out.placements, tensor_meta(val))
    if isinstance(out, (tuple, list)):
        vals = val if isinstance(val, (tuple, list)) else [None] * len(out)
        return type(out)(_with_meta(o, v, mesh) if v is not None else None for o, v in zip(out, vals))
    return out


def _uneven_over_mesh_dims(spec: Any, mesh: DeviceMesh) -> bool:
    """Whether ``spec`` splits a tensor dim over several mesh dims (plain ``Shard``) into pieces of
    unequal size.

    DTensor's reshape rule (torch 2.13, ``_view_ops._analyze_split``) lets the new outer dim of an
    unflatten stay split where its size divides each mesh dim's size alone, not their product:
    ``(24, E) -> (2, 12, E)`` split over both dims of a 2x2 mesh, where each rank holds 6 rows of the
    input but the output's 2 rows split 4 ways leave 1 or 0 rows, so no local view exists (the local
    graph fails on it).
    """
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None:
        return False
    mesh_dims: dict[int, list[int]] = {}
    for m, p in enumerate(spec.placements):
        if type(p) is Shard:
            mesh_dims.setdefault(p.dim, []).append(m)
    shape = spec.tensor_meta.shape
    return any(
        len(dims) > 1 and int(shape[d]) % math.prod(mesh.size(m) for m in dims) != 0 for d, dims in mesh_dims.items()
    )


# Ops whose output length is a tensor value, with the static-shape form of the same result.
_DYNAMIC_SHAPE_FIXES = {
    aten.bincount.default: "count with a static shape: `F.one_hot(y, num_classes).sum(0)`, or "
    "`torch.zeros(num_classes).index_add_(0, y, torch.ones(len(y)))` (both are sums over the batch, "
    "which every plan reduces across ranks); `minlength=` does not fix the length (more classes than it "
    "make it longer)",
}

class _Propagator:
    def __init__(self, traced, mesh, input_placements, output_placements, grad_placements, compute_placements):
        self.traced = traced
        self.grad_placements = grad_placements
        self.compute_placements = compute_placements
        self.mesh = mesh
        self.input_placements = input_placements
        self.output_placements = output_placements
        self.dtensor = DTensor._op_dispatcher.sharding_propagator
        self.batch = BatchSymbols()

    def output_of(self, node: fx.Node) -> Any:
        return node.meta["spmd"].output

    def run(self) -> None:
        placeholders = iter(self.input_placements)
        for node in self.traced.graph_module.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("val"), (torch.SymFloat, float)):
                # A hyperparameter input (possibly specialized to a constant by a guard).
                node.meta["spmd"] = NodeSharding(output=concrete(node.meta["val"]))
            elif node.op == "placeholder":
                placements = next(placeholders)
                self.batch.add_input(node.meta["val"], placements)
                node.meta["spmd"] = NodeSharding(output=tensor_spec(self.mesh, placements, node.meta["val"]))
            elif node.op == "get_attr":
                val = getattr(self.traced.graph_module, node.target)
                # A constant: a tensor (replicated), or an object such as a torch.Generator passed to a random op.
                output = tensor_spec(self.mesh, replicate(self.mesh), val) if isinstance(val, torch.Tensor) else None
                node.meta["spmd"] = NodeSharding(output=output)
            elif node.op == "call_function":
                node.meta["spmd"] = self.call_function(node)
            elif node.op == "output":
                node.meta["spmd"] = self.output(node)
            else:
                raise node_error(UnsupportedOpError, node, f"unexpected fx node kind {node.op!r}", fix="report this graph")

    def output(self, node: fx.Node) -> NodeSharding:
        wanted = []
        for arg, placements in zip(node.args[0], self.output_placements):
            spec = self.output_of(arg)
            wanted.append(spec if placements == AS_PRODUCED else spec_with_meta(self.mesh, placements, spec.tensor_meta))
        return NodeSharding(inputs=tuple(wanted))

    def input_specs(self, node: fx.Node) -> list[Optional[DTensorSpec]]:
        leaves, _ = pytree.tree_flatten((node.args, node.kwargs))
        return [
            self.output_of(a) if isinstance(a, fx.Node) and isinstance(self.output_of(a), DTensorSpec) else None
            for a in leaves
        ]

    def call_function(self, node: fx.Node) -> NodeSharding:
        target = node.target
        if target is operator.getitem:
            return NodeSharding(inputs=(None, None), output=self.output_of(node.args[0])[node.args[1]])
        if target in SYM_SOURCE_OPS:
            spec = self.output_of(node.args[0])
            return NodeSharding(output=from_size_node(target, spec, local_shape(spec), node.args[1:]))
        if is_runtime_scalar(node.meta.get("val")):
            # Arithmetic on hyperparameters (e.g. ``1 - lr * weight_decay``): the same on every rank,
            # computed at run time; its example value stands in for DTensor's schemas.
            return NodeSharding(output=concrete(node.meta["val"]))
        if target in SYM_ARITHMETIC:
            args = [self.output_of(a) if isinstance(a, fx.Node) else a for a in node.args]
            return NodeSharding(output=apply_arithmetic(target, args))

        rule = rules.lookup(target)
        if rule is not None:
            result = rule(node, self)
            if result is not None:
                return result
        return self.dtensor_rule(node)

    def schema_args(self, node: fx.Node, relaid: Optional[dict] = None) -> tuple[tuple, dict]:
        """(args, kwargs) for DTensor's OpSchema: specs for tensors, global ints for DSymInts.

        ``relaid`` maps input nodes to the specs to use instead of their outputs' (a what-if layout).
        """
        relaid = relaid or {}

        def convert(a: Any) -> Any:
            if isinstance(a, fx.Node):
                out = relaid.get(a, self.output_of(a))
                return out.global_value if isinstance(out, DSymInt) else out
            return a

        return pytree.tree_map(convert, (tuple(node.args), dict(node.kwargs)))

    def dtensor_rule(self, node: fx.Node) -> NodeSharding:
        """DTensor's placement for ``node`` (:meth:`_dtensor_rule`), with partial p-norms reduced
        first where DTensor would carry them through an op they do not commute with.

        DTensor (torch 2.13) gives ``_NormPartial`` (a norm over a sharded dim: each rank's norm of
        its shard, combined as ``(sum x^p)^(1/p)``) the reduce op ``"sum"``, so its reduction and
        linear pointwise strategies keep it through ``sum``, ``add``, ``mul``: ``o.norm(dim=0).sum()``
        over a batch-sharded ``o`` summed the ranks' norms' combination instead of the norms. Only
        ops that act on each element alone without arithmetic (views, copies, ``stack``, ``cat``)
        and the norms themselves (which DTensor reduces correctly) keep it. Likewise a partial sum of
        a narrow integer dtype is reduced before an op whose output has another dtype reads it (a
        cast of an int8 count: one device's sum wraps before the cast).
        """
        try:
            sharding = self._dtensor_rule(node)
        except PlacementError:
            sharding = self._gathered_view(node)
            if sharding is None:
                raise
        if node.target in _VIEWS and _uneven_over_mesh_dims(sharding.output, self.mesh):
            sharding = self._regathered_view(node) or self._gathered_view(node) or sharding
        relaid = {}
        out = node.meta.get("val")
        # (A stand-in node of rules.cat_rule has args but no all_input_nodes.)
        for a in dict.fromkeys(a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)):
            spec = self.output_of(a)
            if not isinstance(spec, DTensorSpec):
                continue
            if node.target not in _NORM_PARTIAL_SAFE and any(isinstance(p, _NormPartial) for p in spec.placements):
                placements = [Replicate() if isinstance(p, _NormPartial) else p for p in spec.placements]
                relaid[a] = spec_with_meta(self.mesh, placements, spec.tensor_meta)
            elif (
                spec.tensor_meta.dtype in _NARROW_INTEGERS and any(p.is_partial() for p in spec.placements)
                and isinstance(out, torch.Tensor) and out.dtype != spec.tensor_meta.dtype
            ):
                # A partial sum of a narrow integer (an int8 count) wraps on one device before a cast or
                # a promoting op reads it (256 rows: 0); cast first, the ranks' parts (-128 each) would
                # sum to -256. Reduced in its own dtype first, it wraps as one device's does.
                placements = [Replicate() if p.is_partial() else p for p in spec.placements]
                relaid[a] = spec_with_meta(self.mesh, placements, spec.tensor_meta)
        if not relaid:
            return sharding
        wanted, output = self._dtensor_place(node, self.input_specs(node), relaid)
        return NodeSharding(inputs=tuple(wanted), output=output)

    def _gathered_view(self, node: fx.Node) -> Optional[NodeSharding]:
        """A reshape DTensor refuses on a split input, placed on the input gathered (replicated) on
        the mesh dims that split it; None for other ops, or where that is refused too.

        DTensor (torch 2.13) cannot unflatten a dim whose shard boundaries do not fall between whole
        rows of the new outer dim ("Cannot unflatten unevenly sharded tensor"): ``(T * B, E) ->
        (T, B, E)`` with T not a multiple of the mesh size, which ``nn.MultiheadAttention``'s
        ``need_weights=True`` path does to its output projection (split there on the cost model's
        choice). A gathered input has every layout a view can ask for: an all-gather, not an error.
        """
        return self._view_on_relaid_input(node, lambda placements: [Replicate() if isinstance(p, Shard) else p for p in placements])

    def _regathered_view(self, node: fx.Node) -> Optional[NodeSharding]:
        """A reshape whose input is split on one dim over several mesh dims, placed on the input
        gathered over all but the first of them (see :func:`_uneven_over_mesh_dims`); None if DTensor
        refuses that too or its output is still uneven."""

        def first_shard_per_dim(placements: Sequence[Placement]) -> list[Placement]:
            relaid, seen = list(placements), set()
            for m, p in enumerate(relaid):
                if type(p) is Shard:
                    if p.dim in seen:
                        relaid[m] = Replicate()
                    seen.add(p.dim)
            return relaid

        sharding = self._view_on_relaid_input(node, first_shard_per_dim)
        return None if sharding is None or _uneven_over_mesh_dims(sharding.output, self.mesh) else sharding

    def _view_on_relaid_input(self, node: fx.Node, relay: Callable[[Sequence[Placement]], list[Placement]]) -> Optional[NodeSharding]:
        """DTensor's placement for reshape ``node`` with its input's placements replaced by
        ``relay(placements)``; None for other ops, where ``relay`` changes nothing, or where DTensor
        refuses."""
        if node.target not in _VIEWS or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        src = self.output_of(node.args[0])
        if not isinstance(src, DTensorSpec):
            return None
        placements = relay(src.placements)
        if tuple(placements) == tuple(src.placements):
            return None
        relaid = {node.args[0]: spec_with_meta(self.mesh, placements, src.tensor_meta)}
        try:
            wanted, output = self._dtensor_place(node, self.input_specs(node), relaid)
        except (UnsupportedOpError, PlacementError):
            return None
        return NodeSharding(inputs=tuple(wanted), output=output)

    def _dtensor_rule(self, node: fx.Node) -> NodeSharding:
        """DTensor's placement for ``node``; under a plan that shards the batch, compared by cost
        (communication + compute per rank, :mod:`spmd_expand.cost`) with the placement DTensor gives
        when this node's replicated inputs are split on their batch dims (a local chunk, no
        communication). DTensor's own choice among its strategies is made by the same cost model."""
        current = self.input_specs(node)
        wanted, output = self._dtensor_place(node, current)
        if not self.batch or not isinstance(node, fx.Node):
            return NodeSharding(inputs=tuple(wanted), output=output)
        model = NodeCost(node, self.batch)
        if not model.batch_dims or model.keeps_batch(output):
            return NodeSharding(inputs=tuple(wanted), output=output)
        # DTensor's choice leaves the batch: choose again among its strategies by cost, then try the
        # replicated inputs split on the batch.
        wanted, output = self._dtensor_place(node, current, by_cost=True)
        if model.keeps_batch(output):
            return NodeSharding(inputs=tuple(wanted), output=output)
        relaid = self._batch_split_inputs(node)
        if relaid:
            try:
                alt_wanted, alt_output = self._dtensor_place(node, current, relaid, by_cost=True)
            except (UnsupportedOpError, PlacementError):
                alt_wanted = None
            if (
                alt_wanted is not None
                and model.keeps_batch(alt_output)
                and model.cost(current, alt_wanted, alt_output) < model.cost(current, wanted, output)
            ):
                return NodeSharding(inputs=tuple(alt_wanted), output=alt_output)
        return NodeSharding(inputs=tuple(wanted), output=output)

    def _batch_split_inputs(self, node: fx.Node) -> dict:
        """Input node -> its spec split on a batch dim on each batch mesh dim where it is replicated."""
        relaid = {}
        for a in pytree.tree_leaves((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node)):
            if not isinstance(a, fx.Node) or a in relaid:
                continue
            spec = self.output_of(a)
            if not isinstance(spec, DTensorSpec):
                continue
            placements = list(spec.placements)
            for m, dims in self.batch.dims_of(a.meta.get("val")).items():
                if isinstance(placements[m], Replicate) and not any(
                    isinstance(p, Shard) and p.dim == min(dims) for p in placements
                ):
                    placements[m] = Shard(min(dims))
            if tuple(placements) != tuple(spec.placements):
                relaid[a] = spec_with_meta(self.mesh, placements, spec.tensor_meta)
        return relaid

    def _dtensor_place(
        self, node: fx.Node, current: list, relaid: Optional[dict] = None, by_cost: bool = False
    ) -> tuple[list, Any]:
        """(input specs wanted, output spec) from DTensor, with ``relaid`` inputs (see schema_args);
        ``by_cost``: DTensor's strategy is chosen by :func:`spmd_expand.cost.choosing_by_cost`."""
        op = node.target
        args, kwargs = self.schema_args(node, relaid)
        schema_info = self.dtensor.op_to_schema_info.get(op) or self.dtensor.op_to_schema_info_for_single_dim_strategy.get(op)
        schema = OpSchema(op, args, kwargs, schema_info=schema_info)
        try:
            if by_cost:
                # Not the cached entry point: the choice depends on this node (its batch dims, FLOPs).
                with choosing_by_cost(node, self.batch):
                    sharding = self.dtensor.propagate_op_sharding_non_cached(schema)
            else:
                sharding = self.dtensor.propagate_op_sharding(schema)
        except NotImplementedError as e:
            raise node_error(
                UnsupportedOpError,
                node,
                f"no sharding rule for {op}: {str(e).splitlines()[0]}",
                placements=[s.placements for s in current if s is not None],
                fix=_FORM_WITH_RULES.get(op)
                or f"register the placements this op accepts with DTensor's "
                f"torch.distributed.tensor.experimental.register_sharding({op}) (spmd_expand looks rules up "
                f"there), or pass module_override= to swap the submodule for a traceable stand-in",
            ) from e
        except Exception as e:  # noqa: BLE001 - DTensor raises assorted types for unsatisfiable inputs
            if "DynamicOutputShape" in type(e).__name__ or "DynamicOutputShape" in str(e):
                raise node_error(
                    TraceError,
                    node,
                    f"{op}'s output shape depends on tensor values (a boolean mask, nonzero, unique, "
                    f"masked_select): no plan can split a shape that is only known at run time",
                    placements=[s.placements for s in current if s is not None],
                    fix=_DYNAMIC_SHAPE_FIXES.get(op, "keep shapes static: multiply by the mask or use torch.where "
                    "instead of indexing with it (e.g. `(out * (out > 0)).sum()` for `out[out > 0].sum()`)"),
                ) from e
            raise node_error(
                PlacementError,
                node,
                f"DTensor could not place {op}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                placements=[s.placements for s in current if s is not None],
                fix="choose a plan whose placements this op accepts (see the input placements above)",
            ) from e
        if sharding.needs_redistribute and sharding.redistribute_schema is not None:
            wanted_args = (tuple(sharding.redistribute_schema.args_schema), dict(sharding.redistribute_schema.kwargs_schema))
            wanted_leaves, _ = pytree.tree_flatten(wanted_args)
            wanted = [
                w if cur is not None and isinstance(w, DTensorSpec) else None
                for w, cur in zip(wanted_leaves, current)
            ]
            # DTensor leaves tensor_meta off some suggested specs; the tensor is the same as before.
            wanted = [
                spec_with_meta(self.mesh, w.placements, c.tensor_meta) if w is not None and w.tensor_meta is None else w
                for w, c in zip(wanted, current)
            ]
        elif relaid:
            leaves, _ = pytree.tree_flatten((args, kwargs))
            wanted = [w if cur is not None else None for w, cur in zip(leaves, current)]
        else:
            wanted = current
        return wanted, _with_meta(sharding.output_spec, node.meta.get("val"), self.mesh)


def propagate(
    traced: TracedStep,
    mesh: DeviceMesh,
    input_placements: list,
    output_placements: list,
    grad_placements: Callable[[str], Optional[tuple]],
    compute_placements: Callable[[str], tuple],
) -> None:
    """Annotate every node of ``traced.graph_module`` with ``node.meta["spmd"]`` (a :class:`NodeSharding`).

    Args:
        traced: the global graph from :func:`spmd_expand.trace.trace_step`.
        mesh: the device mesh of the plan.
        input_placements: a placement tuple (one per mesh dim) for each graph input, in order.
        output_placements: the placement tuple each graph output must end with (``AS_PRODUCED``:
            as propagated).
        grad_placements: parameter FQN -> placements its gradient is reduced to (None: rank-local;
            ``AS_PRODUCED``: not reduced, e.g. while gradient sync is off).
        compute_placements: parameter FQN -> placements the module reads it with.

    Raises:
        UnsupportedOpError: an op with no rule in DTensor or :mod:`spmd_expand.rules`.
        PlacementError: DTensor cannot satisfy an op with the placements that reach it.
    """
    _Propagator(traced, mesh, input_placements, output_placements, grad_placements, compute_placements).run()
