"""``regather_for_backward``: FSDP's ``reshard_after_forward`` as a global-graph pass.

Under ``reshard_after_forward`` a parameter gathered for forward is freed after forward and gathered
again where backward (or a later micro-batch's forward) reads it, as FSDP does (Zhao et al., "PyTorch
FSDP", VLDB 2023, section 3.2). On the traced global graph this is: every region of the step after the
first (each backward, and the forward of each later micro-batch) gets its own copy of the parameter's
``unshard`` marker and of the view chain on it; propagation then places each copy, so expansion emits
one all-gather per region.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from ..annotate import VIEW_OPS, regions
from ..errors import PassError
from ..ops import UNSHARD
from .manager import SpmdPass

__all__ = ["RegatherForBackward", "regather_for_backward"]


def regather_for_backward(gm: fx.GraphModule, reshards: Callable[[str], bool] = lambda fqn: True) -> int:
    """Give each region after the first its own ``unshard`` of every parameter it reads.

    ``reshards(fqn)`` picks the parameters (by FQN) this applies to; the others keep the gathered
    copy of their first region. Returns the number of ``unshard`` markers added. Idempotent: a second
    run adds none.
    """
    graph = gm.graph
    region_of = regions(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    added = 0
    for marker in [n for n in graph.nodes if n.target is UNSHARD and reshards(n.args[1])]:
        closure = [marker]
        for node in closure:  # grows while iterating: the marker's view chain, in graph order
            closure.extend(u for u in node.users if u.target in VIEW_OPS and u.args[0] is node)
        members = set(closure)
        home = region_of[marker]
        uses: dict[tuple[str, int], list[tuple[fx.Node, fx.Node]]] = {}
        for value in closure:
            for user in value.users:
                if user not in members and region_of[user] != home:
                    uses.setdefault(region_of[user], []).append((value, user))
        for region, pairs in uses.items():
            first = min((user for _, user in pairs), key=order.__getitem__)
            copies: dict[fx.Node, fx.Node] = {}

            def copy(value: fx.Node) -> fx.Node:
                if value not in copies:
                    args = value.args if value is marker else (copy(value.args[0]), *value.args[1:])
                    new = graph.call_function(value.target, args, value.kwargs)
                    new.meta = dict(value.meta)
                    # The copy belongs to the region it serves (a backward region's tag, or none).
                    new.meta.pop("custom", None)
                    if "custom" in first.meta:
                        new.meta["custom"] = first.meta["custom"]
                    copies[value] = new
                return copies[value]

            with graph.inserting_before(first):
                for value, user in pairs:
                    user.replace_input_with(value, copy(value))
            added += 1
    if added:
        graph.lint()
        gm.recompile()
    return added


class RegatherForBackward(SpmdPass):
    """Global pass: re-gather the parameters the plan reshards after forward
    (:meth:`~spmd_expand.plans.ResolvedPlan.reshards_after_forward`: FSDP's blocks by default, not its
    root block); a no-op for plans that keep gathered parameters (DDP, TP,
    ``reshard_after_forward=False``).

    Requires ``unshard`` markers (the tracer puts one where the module first reads each parameter).
    Ensures no parameter's gathered value (or a view of it) is used outside the region of its marker.
    """

    name = "regather_for_backward"
    stage = "global"

    def call(self, gm: fx.GraphModule) -> PassResult:
        return PassResult(gm, regather_for_backward(gm, self.context(gm).plan.reshards_after_forward) > 0)

    def ensures(self, gm: fx.GraphModule) -> None:
        reshards = self.context(gm).plan.reshards_after_forward
        region_of = regions(gm.graph)
        for marker in gm.graph.nodes:
            if marker.target is not UNSHARD or not reshards(marker.args[1]):
                continue
            closure = [marker]
            for node in closure:
                closure.extend(u for u in node.users if u.target in VIEW_OPS and u.args[0] is node)
            for value in closure:
                for user in value.users:
                    if user.target not in VIEW_OPS and region_of[user] != region_of[marker]:
                        raise PassError(
                            f"pass 'regather_for_backward': {user.name} reads parameter {marker.args[1]!r} "
                            f"gathered in another region ({marker.name})"
                        )
