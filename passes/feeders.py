"""What the communication passes agree on about a graph: which nodes are collectives, which only lay
out bytes for one, and which write into graph inputs.

``bucketing`` and ``overlap`` both move a collective together with the nodes that exist only to feed
it (:func:`feeders`): a bucket's flatten/concatenate, an uneven shard's padding. Such nodes may differ
between ranks (expansion pads only the ranks whose shard is short), so a decision a pass takes must
not depend on them: every rank must issue the same collectives in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..graph_stats import COLLECTIVES

__all__ = ["WAIT", "LAYOUT_OPS", "collective_kind", "lays_out", "aliases_input", "writes_input", "feeders"]


def collective_kind(node: fx.Node) -> Optional[str]:
    """The kind of a collective start (``"all_reduce"``, ``"all_gather"``, ...; see
    :data:`spmd_expand.graph_stats.COLLECTIVES`), or None for any other node."""
    return COLLECTIVES.get(node.target) if node.op == "call_function" else None


WAIT = torch.ops._c10d_functional.wait_tensor.default
aten = torch.ops.aten

# Ops that only lay out bytes for a collective (a bucket's flatten/concatenate, a shard's padding):
# they move with the collective they feed. Compute that only feeds a collective (the last gradient
# of a bucket) stays where backward put it.
LAYOUT_OPS = frozenset(
    {
        aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
        aten.select.int, aten.narrow.default, aten.t.default, aten.permute.default, aten.transpose.int,
        aten.expand.default, aten.detach.default, aten.alias.default, aten.squeeze.dim,
        aten.unsqueeze.default, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default,
        aten.copy_.default, aten.copy.default, aten.clone.default, aten.contiguous.default,
        aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default, aten.zeros.default,
        aten.new_zeros.default, aten.full.default, aten.constant_pad_nd.default, aten._to_copy.default,
        aten.as_strided.default, aten.flatten.using_ints, aten.chunk.default,
    }
)


def lays_out(node: fx.Node) -> bool:
    """Whether ``node`` only lays out bytes (:data:`LAYOUT_OPS`, or one of torch's bucketing ops)."""
    target = node.target
    return target in LAYOUT_OPS or getattr(target, "namespace", None) == "bucketing"


def aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s output is (a view of) a graph input: follows ops whose first return aliases
    their first argument (views, in-place ops) back to a placeholder."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or not node.args:
            return False
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return False
    return node.op == "placeholder"


def writes_input(node: fx.Node) -> bool:
    """Whether ``node`` writes in place into a graph input (a parameter or state's ``copy_``)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return False
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            if value.op == "placeholder" or aliases_input(value):
                return True
    return any(
        isinstance(node.kwargs.get(arg.name), fx.Node) and aliases_input(node.kwargs[arg.name])
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def feeders(start: fx.Node) -> list[fx.Node]:
    """``start`` and the layout nodes that exist only to feed it (all their users are in the set),
    in graph order."""
    members = {start}
    stack = [start]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if (
                arg not in members
                and arg.op == "call_function"
                and lays_out(arg)
                and not writes_input(arg)
                and collective_kind(arg) is None
                and arg.target is not WAIT
                and all(u in members for u in arg.users)
            ):
                members.add(arg)
                stack.append(arg)
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    return sorted(members, key=order.__getitem__)
