"""Loss parallelism: cross-entropy over class-sharded (vocab-parallel) logits, without gathering them.

A step that computes its loss inside ``torch.distributed.tensor.parallel.loss_parallel()``::

    logits = model(idx)                                  # ColwiseParallel(output_layouts=Shard(-1)) head
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()

asks for torch's vocab-parallel cross-entropy (``torch/distributed/tensor/parallel/loss.py``): the
log-softmax all-reduces a max and a sum of exponentials of shape ``(N, 1)``, the NLL picks each target's
log-probability on the rank that holds it (``_MaskPartial``) and all-reduces it, and backward fuses
the NLL and log-softmax gradients into one local computation. The logits are never gathered.

In eager DTensor the context swaps in custom op handlers; here it works in three steps:

1. trace: :class:`MarkLossParallel` tags every node recorded while the context is active
   (``node.meta["custom"]["spmd_loss_parallel"]``);
2. propagate: :data:`RULES` place a tagged ``_log_softmax`` / ``nll_loss_forward`` whose input is
   sharded on the class dim on exactly one mesh dim as torch's handlers do (output sharded like the
   input; the loss ``Replicate`` on that mesh dim and ``Partial`` on batch-sharded ones). The
   backward ops follow their forward: ``nll_loss_backward`` over such a log-softmax, whose only users
   are that log-softmax's backward, is fused as in torch, and that backward becomes the identity;
3. expand: each such node's local computation is torch's own handler, traced on this rank's local
   shards (:attr:`spmd_expand.spec.NodeSharding.local_op`).

Anything else (untagged nodes, logits not sharded on the class dim, a log-softmax whose output also
feeds something other than the NLL, the backward of a loss with class weights) keeps DTensor's
ordinary rules: the same values, with the logits gathered. Unlike eager ``loss_parallel``, ``reduction="mean"`` also works on N-D meshes: the
traced step computes it as a sum over a summed target count (see ``trace._nll_loss_mean_as_sum``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.overrides import TorchFunctionMode

from .spec import NodeSharding, spec_with_meta, tensor_meta

__all__ = ["LOSS_PARALLEL_KEY", "MarkLossParallel", "loss_parallel_active", "RULES"]

aten = torch.ops.aten

LOSS_PARALLEL_KEY = "spmd_loss_parallel"


def _handlers() -> dict:
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    return customized_loss_ops


def loss_parallel_active() -> bool:
    """Whether torch's ``loss_parallel()`` context is active (its op handlers are installed)."""
    op = aten._log_softmax.default
    return DTensor._op_dispatcher._custom_op_handlers.get(op) is _handlers()[op]


class MarkLossParallel(TorchFunctionMode):
    """While tracing, tags the nodes of every torch call made inside ``loss_parallel()``.

    Needs ``fx_traceback.preserve_node_meta()``; the tag survives functionalization, as the backward
    tag of ``trace._MarkBackward`` does.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if loss_parallel_active():
            with fx_traceback.annotate({LOSS_PARALLEL_KEY: True}):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _tagged(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(LOSS_PARALLEL_KEY))


def _class_mesh_dim(spec: DTensorSpec, dim: int) -> Optional[int]:
    """The one mesh dim that shards tensor dim ``dim`` while every other mesh dim is ``Shard`` of
    another dim or ``Replicate`` (torch's ``loss._find_all_reduce_mesh_dim``); None otherwise."""
    sharding = [m for m, p in enumerate(spec.placements) if type(p) is Shard and p.dim == dim]
    if len(sharding) != 1:
        return None
    if not all(type(p) in (Shard, Replicate) for p in spec.placements):
        return None
    return sharding[0]


def _channel_dim(spec: DTensorSpec) -> int:
    return 1 if len(spec.tensor_meta.shape) >= 2 else 0


def _target_placements(spec: DTensorSpec, channel_dim: int) -> tuple:
    """Placements of the targets that go with logits ``spec``: the class dim dropped (torch's rule)."""
    from torch.distributed.tensor._ops._math_ops import _skip_dim, replicate_reduction_dims

    return _skip_dim(replicate_reduction_dims(spec.placements, [channel_dim]), channel_dim)


def _local_handler(op, args_template: tuple, specs: list[Optional[DTensorSpec]], plain: frozenset[int]) -> Callable:
    """A function of local tensors that runs torch's loss-parallel handler for ``op`` on them.

    ``args_template`` is the node's args with tensor leaves in ``specs`` order; leaf ``i`` becomes a
    DTensor with ``specs[i]`` unless ``i`` is in ``plain`` (the handler takes it as a plain tensor,
    as eager autograd hands it over). Outputs are returned as local tensors.
    """
    handler = _handlers()[op]

    def run(*local: torch.Tensor) -> Any:
        values = iter(local)
        index = iter(range(len(specs)))

        def wrap(leaf: Any) -> Any:
            if not isinstance(leaf, fx.Node):
                return leaf
            i, value = next(index), next(values)
            if i in plain or specs[i] is None:
                return value
            spec = specs[i]
            return DTensor.from_local(
                value, spec.mesh, spec.placements, run_check=False, shape=spec.tensor_meta.shape, stride=spec.tensor_meta.stride
            )

        args = pytree.tree_map(wrap, args_template)
        out = handler(op, tuple(args), {})
        return pytree.tree_map(lambda o: o.to_local() if isinstance(o, DTensor) else o, out)

    return run


def _per_leaf(node: fx.Node, specs: list[Optional[DTensorSpec]]) -> tuple:
    """``NodeSharding.inputs`` (one entry per pytree leaf of the node's args) from the specs of its
    tensor arguments, in order."""
    it = iter(specs)
    leaves, _ = pytree.tree_flatten((node.args, node.kwargs))
    return tuple(next(it) if isinstance(leaf, fx.Node) else None for leaf in leaves)


def _placements_with(spec: DTensorSpec, mesh_dim: int, on_mesh_dim, elsewhere) -> tuple:
    return tuple(on_mesh_dim if m == mesh_dim else elsewhere(p) for m, p in enumerate(spec.placements))


def log_softmax_rule(node: fx.Node, prop) -> Optional[NodeSharding]:
    """``_log_softmax(x, dim, half_to_float)`` over a class-sharded ``x``: output sharded like ``x``."""
    if not _tagged(node):
        return None
    spec = prop.output_of(node.args[0])
    dim = node.args[1] % len(spec.tensor_meta.shape)
    if _class_mesh_dim(spec, dim) is None:
        return None
    out = spec_with_meta(prop.mesh, spec.placements, tensor_meta(node.meta["val"]))
    local = _local_handler(node.target, tuple(node.args), [spec], frozenset())
    return NodeSharding(inputs=_per_leaf(node, [spec]), output=out, local_op=local)


def _is_loss_parallel(node: Any, target) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.target is target
        and "spmd" in node.meta
        and node.meta["spmd"].local_op is not None
    )


def _through_detach(node: fx.Node) -> fx.Node:
    # Saved activations reach backward through detach() aliases.
    while node.op == "call_function" and node.target in (aten.detach.default, aten.alias.default):
        node = node.args[0]
    return node


def _reduction_placements(spec: DTensorSpec, mesh_dim: int) -> tuple:
    """A sum over all rows: complete on the class mesh dim, a partial sum over batch-sharded ones."""
    return _placements_with(spec, mesh_dim, Replicate(), lambda p: Partial() if isinstance(p, Shard) else p)


def nll_loss_forward_rule(node: fx.Node, prop) -> Optional[NodeSharding]:
    """``nll_loss_forward(x, target, weight, reduction, ignore_index)`` over class-sharded log-probs."""
    if not _tagged(node):
        return None
    x, target, weight, reduction = node.args[:4]
    spec = prop.output_of(x)
    channel_dim = _channel_dim(spec)
    mesh_dim = _class_mesh_dim(spec, channel_dim)
    if mesh_dim is None:
        return None
    target_spec = spec_with_meta(prop.mesh, _target_placements(spec, channel_dim), prop.output_of(target).tensor_meta)
    replicated = tuple(Replicate() for _ in spec.placements)
    weight_spec = spec_with_meta(prop.mesh, replicated, prop.output_of(weight).tensor_meta) if isinstance(weight, fx.Node) else None
    result_val, total_val = node.meta["val"]
    if reduction == 0:  # none: one loss per target, placed like the targets
        result = spec_with_meta(prop.mesh, target_spec.placements, tensor_meta(result_val))
        total = spec_with_meta(prop.mesh, replicated, tensor_meta(total_val))
    else:
        reduced = _reduction_placements(spec, mesh_dim)
        if reduction == 1 and any(isinstance(p, Partial) for p in reduced):
            return None  # a mean of per-rank means; the traced step never asks for it (mean -> sum)
        result = spec_with_meta(prop.mesh, reduced, tensor_meta(result_val))
        # The target count (or weight sum) is a sum over this rank's rows, like the loss.
        total = spec_with_meta(prop.mesh, reduced, tensor_meta(total_val))
    specs = [spec, target_spec] + ([weight_spec] if weight_spec is not None else [])
    local = _local_handler(node.target, tuple(node.args), specs, frozenset())
    return NodeSharding(inputs=_per_leaf(node, specs), output=(result, total), local_op=local)


def nll_loss_backward_rule(node: fx.Node, prop) -> Optional[NodeSharding]:
    """``nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight)``, fused with
    the log-softmax backward as torch does, when ``x`` is a loss-parallel log-softmax whose gradient
    goes nowhere else."""
    grad, x, target, weight, reduction, _, total_weight = node.args[:7]
    if isinstance(weight, fx.Node):
        # torch 2.13's fused handler gathers the class weights with the raw targets, ignored ones
        # (-100) included, and fails at run time; DTensor's rules compute the same gradient.
        return None
    source = _through_detach(x)
    if not _is_loss_parallel(source, aten._log_softmax.default):
        return None
    users = list(node.users)
    if not users or not all(
        u.target is aten._log_softmax_backward_data.default and u.args[0] is node and _through_detach(u.args[1]) is source
        for u in users
    ):
        return None
    spec = prop.output_of(x)
    channel_dim = _channel_dim(spec)
    # The fused gradient assumes the log-softmax normalized over the NLL's class dim.
    if _class_mesh_dim(spec, channel_dim) is None or source.args[1] % len(spec.tensor_meta.shape) != channel_dim:
        return None
    replicated = tuple(Replicate() for _ in spec.placements)
    target_spec = spec_with_meta(prop.mesh, _target_placements(spec, channel_dim), prop.output_of(target).tensor_meta)
    grad_placements = target_spec.placements if reduction == 0 else replicated
    grad_spec = spec_with_meta(prop.mesh, grad_placements, prop.output_of(grad).tensor_meta)
    # The handler divides by total_weight as a plain tensor: it must hold the global count.
    total_spec = spec_with_meta(prop.mesh, replicated, prop.output_of(total_weight).tensor_meta)
    specs = [grad_spec, spec, target_spec, total_spec]
    out = spec_with_meta(prop.mesh, spec.placements, tensor_meta(node.meta["val"]))
    local = _local_handler(node.target, tuple(node.args), specs, frozenset({len(specs) - 1}))
    return NodeSharding(inputs=_per_leaf(node, specs), output=out, local_op=local)


def log_softmax_backward_rule(node: fx.Node, prop) -> Optional[NodeSharding]:
    """``_log_softmax_backward_data(grad, output, dim, dtype)`` after a fused NLL backward: the
    identity (a dtype cast), as torch's handler."""
    grad = node.args[0]
    if not _is_loss_parallel(grad, aten.nll_loss_backward.default) and not _is_loss_parallel(grad, aten.nll_loss2d_backward.default):
        return None
    grad_spec = prop.output_of(grad)
    output_spec = prop.output_of(node.args[1])
    out = spec_with_meta(prop.mesh, grad_spec.placements, tensor_meta(node.meta["val"]))
    local = _local_handler(node.target, tuple(node.args), [grad_spec, output_spec], frozenset())
    return NodeSharding(inputs=_per_leaf(node, [grad_spec, output_spec]), output=out, local_op=local)


RULES: dict[Any, Callable] = {
    aten._log_softmax.default: log_softmax_rule,
    aten.nll_loss_forward.default: nll_loss_forward_rule,
    aten.nll_loss2d_forward.default: nll_loss_forward_rule,
    aten.nll_loss_backward.default: nll_loss_backward_rule,
    aten.nll_loss2d_backward.default: nll_loss_backward_rule,
    aten._log_softmax_backward_data.default: log_softmax_backward_rule,
}
"""Propagation rules for the ops torch's ``loss_parallel()`` handles; each returns None (DTensor's
ordinary rule) unless the node is part of a loss-parallel cross-entropy."""
