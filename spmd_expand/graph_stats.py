"""Facts about an expanded graph that users and tools report: its collectives and their bytes, its
FLOPs, its live bytes."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry

from .spec import concrete

__all__ = [
    "COLLECTIVES", "CollectiveStats", "collective_bytes", "collective_stats", "node_flops", "graph_flops",
    "annotate_local_values", "live_bytes", "peak_live_bytes",
]

_c10d = torch.ops._c10d_functional
COLLECTIVES = {  # collective start ops of torch.distributed._functional_collectives -> kind
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",  # what a bucketed all-gather becomes
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
    _c10d.broadcast.default: "broadcast",
}


@dataclass
class CollectiveStats:
    """Collectives of one graph run: ``count`` and input ``bytes`` (this rank's payload) per kind."""

    count: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    @property
    def total_count(self) -> int:
        return sum(self.count.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"count": self.count[k], "bytes": self.bytes[k]} for k in sorted(self.count)}


def collective_bytes(node: fx.Node, kind: str) -> int:
    """Bytes collective ``node`` (of ``kind``) sends from this rank: its input tensor's size, derived
    from the output value recorded on the node (``node.meta["val"]``, from the traced
    redistribution): an all_gather's input is its output over the group size, a reduce_scatter's its
    output times the group size. 0 without a recorded value."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    nbytes = val.numel() * val.element_size()
    if kind == "all_gather":
        nbytes //= node.args[1]
    elif kind == "reduce_scatter":
        nbytes *= node.args[2]
    return nbytes


def collective_stats(gm: fx.GraphModule, skip: Collection[str] = ()) -> CollectiveStats:
    """Count the functional collectives of ``gm`` and the bytes each sends from this rank.

    Bytes are the size of the collective's input tensor on this rank (:func:`collective_bytes`).
    ``skip``: names of collective nodes not counted (ones that do not run as collectives, e.g. the
    all-reduce folded into the rank check: :meth:`~spmd_expand.pipeline.StepArtifacts.collectives`).
    """
    stats = CollectiveStats()
    for node in gm.graph.nodes:
        kind = COLLECTIVES.get(node.target)
        if kind is None or node.name in skip:
            continue
        stats.count[kind] += 1
        stats.bytes[kind] += collective_bytes(node, kind)
    return stats


def node_flops(node: fx.Node) -> int:
    """FLOPs of one call node by torch's flop registry (``torch.utils.flop_counter.flop_registry``:
    matmuls, convolutions, attention, forward and backward), from the fake tensors in
    ``node.meta["val"]`` of it and its arguments; symbolic sizes count at their hints. 0 for an op the
    registry has no formula for.

    Raises:
        KeyError: a node read has no ``meta["val"]``.
    """
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None)) if node.op == "call_function" else None
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    return int(concrete(formula(*args, **kwargs, out_val=node.meta["val"])))


def graph_flops(gm: fx.GraphModule, ops: Optional[Collection[Any]] = None) -> int:
    """Total :func:`node_flops` of ``gm``; with ``ops`` (op overload packets, e.g.
    ``torch.ops.aten.convolution``), of those ops only."""
    return sum(
        node_flops(n) for n in gm.graph.nodes if ops is None or getattr(n.target, "overloadpacket", None) in ops
    )


def annotate_local_values(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
    """Set ``node.meta["val"]`` (a fake tensor of the local shape) on every node of a local graph.

    Runs torch's ``FakeTensorProp`` over ``gm`` with fake copies of ``example_inputs`` (this rank's
    local tensors, real or fake); collectives have meta kernels, so no communication happens.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.no_grad():  # the graph writes its inputs in place (copy_), which autograd forbids on views
        fakes = [mode.from_tensor(t.detach()) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def _bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_bytes(v) for v in val)
    return 0


def live_bytes(gm: fx.GraphModule) -> tuple[int, list[int]]:
    """Bytes of live tensors at each node of ``gm``, from a liveness walk in graph order.

    Needs ``node.meta["val"]`` on every node (see :func:`annotate_local_values`). Inputs are live
    throughout; a computed value is live from its node to its last use; outputs of view ops alias
    their input (no bytes of their own, but they keep it alive). Returns ``(input bytes, live)``
    where ``live[i]`` is the bytes live while node ``i`` (in ``gm.graph.nodes`` order) runs: the
    inputs, every earlier value still to be used, and node ``i``'s own output.
    """
    from .annotate import VIEW_OPS

    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    owner: dict[fx.Node, fx.Node] = {}  # value -> node whose storage it uses
    for n in nodes:
        if n.op == "call_function" and n.target in VIEW_OPS and isinstance(n.args[0], fx.Node):
            owner[n] = owner.get(n.args[0], n.args[0])
        elif n.op == "call_function" and n.target is operator.getitem:
            owner[n] = n  # an element of a multi-output op is its own buffer
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for user in n.users:
            base = owner.get(n, n)
            last_use[base] = max(last_use.get(base, 0), order[user])
    inputs = sum(_bytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    frees: dict[int, int] = {}
    live = inputs
    timeline = []
    for n in nodes:
        if n.op in ("placeholder", "output") or n in owner and owner[n] is not n:
            timeline.append(live)
            continue
        size = 0 if any(u.target is operator.getitem for u in n.users) else _bytes(n.meta.get("val"))
        live += size
        timeline.append(live)
        frees[last_use.get(n, order[n])] = frees.get(last_use.get(n, order[n]), 0) + size
        live -= frees.pop(order[n], 0)
    return inputs, timeline


def peak_live_bytes(gm: fx.GraphModule) -> dict[str, int]:
    """Peak bytes of live tensors while ``gm`` runs (:func:`live_bytes`). Returns ``{"inputs": bytes,
    "peak": bytes}`` where ``peak`` includes the inputs."""
    inputs, timeline = live_bytes(gm)
    return {"inputs": inputs, "peak": max([inputs, *timeline])}
