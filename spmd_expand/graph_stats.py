"""Facts about an expanded graph that users and tools report: its collectives and their bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["COLLECTIVES", "CollectiveStats", "collective_stats"]

_c10d = torch.ops._c10d_functional
COLLECTIVES = {
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_gather_into_tensor.default: "all_gather",
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


def collective_stats(gm: fx.GraphModule) -> CollectiveStats:
    """Count the functional collectives of ``gm`` and the bytes each sends from this rank.

    Bytes are the size of the collective's input tensor on this rank (``numel * element_size``),
    derived from the output value recorded on the node (``node.meta["val"]``, from the traced
    redistribution): an all_gather's input is its output over the group size, a reduce_scatter's its
    output times the group size.
    """
    stats = CollectiveStats()
    for node in gm.graph.nodes:
        kind = COLLECTIVES.get(node.target)
        if kind is None:
            continue
        stats.count[kind] += 1
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            out_bytes = val.numel() * val.element_size()
            if kind == "all_gather":
                out_bytes //= node.args[1]
            elif kind == "reduce_scatter":
                out_bytes *= node.args[2]
            stats.bytes[kind] += out_bytes
    return stats
