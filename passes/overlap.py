"""``overlap``: issue each collective as early as it can go and wait for it as late as it can.

A functional collective is a start (``_c10d_functional.all_reduce`` ...) that returns at once and a
``wait_tensor`` that blocks until the result is there; whatever runs between the two runs while the
bytes move. Expansion places both where the value is redistributed, back to back. This pass reorders
the graph (and only moves collectives, the nodes that exist only to feed them, and waits):

* **wait late**: each ``wait_tensor`` moves to just before the first node that uses its result (or
  the first in-place write into a graph input, whichever comes first: a collective in flight may
  still read its input);
* **issue early**: each collective start (with the nodes that exist only to feed it: a bucket's
  flatten/concatenate, a padding) moves to just after the last node it depends on;
* **issue at the start what only the batch decides**: a collective whose input is computed from graph
  inputs alone, by deterministic ops that exist only to feed it (views may be shared), moves to the
  top of the graph with that computation. The loss denominator is the case that matters: the count
  of targets not ignored (``trace._nll_loss_mean_as_sum`` counts it from the targets), all-reduced
  over the data-parallel ranks, used to block after the forward; it now flies during the forward;
* **bounded prefetch of all-gathers**: an all-gather is not issued before the wait of the all-gather
  issued before it, so at most two gathered buckets are alive at once: FSDP2's default (prefetch the
  next block's parameters while the current block computes; Zhao et al., "PyTorch FSDP", VLDB 2023,
  section 3.3.1 "backward/forward prefetching");
* a collective that reads a graph input (a parameter, a state, or a view of one) never moves above
  a node that writes in place into a graph input (``copy_`` into a parameter or state), and its wait
  never sinks below one (a collective in flight may still read its input); a collective that reads
  only values the step computed (the returned loss) is free to cross them. Collectives may change
  their issue order (gradients are reduced in the order backward produces them, not the order the
  optimizer reads them); every rank runs the same deterministic pass on the same graph, so all ranks
  issue them in the same order, which is what ``torch.distributed`` requires.

The cost model is the simplest that explains the gain: communication is free while compute runs, so
the best place for a start is as early as its inputs allow and for a wait as late as its users allow;
the all-gather bound keeps the memory of FSDP's sharding. torch's own scheduler
(``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing``) estimates compute with
a GPU roofline (Triton) and collectives with an NCCL model; it does not run on CPU ranks in torch 2.13.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import PassError
from .feeders import WAIT, aliases_input, collective_kind, feeders, writes_input
from .manager import SpmdPass

__all__ = ["OverlapCollectives"]

def _reads_input(members: list[fx.Node]) -> bool:
    """Whether a collective (``members``: its start and feeders, :func:`~.feeders.feeders`) reads a
    graph input or a view of one, whose bytes an in-place write could change under it."""
    inside = set(members)
    return any(
        arg not in inside and (arg.op == "placeholder" or aliases_input(arg))
        for m in members
        for arg in m.all_input_nodes
    )


def _recomputable(node: fx.Node) -> bool:
    """A deterministic op without in-place writes (moving it changes no value)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return (
        not target._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in target.tags
        and collective_kind(node) is None
        and target is not WAIT
    )


def _is_view(node: fx.Node) -> bool:
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _input_cone(members: list[fx.Node]) -> list[fx.Node]:
    """The compute that exists only to feed a collective (``members``: its start and feeders) when
    it reads nothing but graph inputs, in graph order; else ``[]``.

    The loss denominator is one: the count of targets not ignored, summed over the data-parallel
    ranks. It depends on no activation, so it (and its all-reduce) can run when the step starts.
    """
    inside = set(members)
    cone: set[fx.Node] = set()
    stack = [a for m in members for a in m.all_input_nodes if a not in inside]
    while stack:
        node = stack.pop()
        if node in cone or node.op in ("placeholder", "get_attr"):
            continue
        if not _recomputable(node):
            return []
        cone.add(node)
        stack.extend(node.all_input_nodes)
    # A node other nodes use too moves only if it is a view (it then keeps no new bytes alive longer).
    if any(u not in cone and u not in inside and not _is_view(n) for n in cone for u in n.users):
        return []
    order = {n: i for i, n in enumerate(members[0].graph.nodes)}
    return sorted(cone, key=order.__getitem__)


class OverlapCollectives(SpmdPass):
    """Local pass: collectives issued early, waited late (see the module docstring).

    Requires each collective waited by exactly one ``wait_tensor``. Ensures the graph is still in
    topological order (``graph.lint``) with the same collectives. Collectives may be issued in another
    order than before: the pass is deterministic and every rank runs it on the same graph, so every
    rank issues them in the same new order.
    """

    name = "overlap"
    stage = "local"
    run_after = ("bucketing",)

    def requires(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if collective_kind(node) is not None:
                users = list(node.users)
                if len(users) != 1 or users[0].target is not WAIT:
                    raise PassError(f"pass 'overlap': {node.name} is not waited by exactly one wait_tensor")
        self._collectives = self._collective_names(gm)

    def ensures(self, gm: fx.GraphModule) -> None:
        gm.graph.lint()
        if self._collective_names(gm) != self._collectives:
            raise PassError("pass 'overlap' added or removed collectives; it may only move them")

    @staticmethod
    def _collective_names(gm: fx.GraphModule) -> set:
        return {node.name for node in gm.graph.nodes if collective_kind(node) is not None}

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        moved = 0
        # Wait late: just before the first user (nodes that only issue collectives may stay between).
        fed_by = {n: feeders(n) for n in graph.nodes if collective_kind(n) is not None}
        issuing = {m for members in fed_by.values() for m in members}
        for wait in [n for n in graph.nodes if n.target is WAIT]:
            users = list(wait.users)
            if not users:
                continue
            order = {n: i for i, n in enumerate(graph.nodes)}
            first = min(users, key=order.__getitem__)
            # Nor past an in-place write into a graph input, when the collective reads one: it may
            # still be reading its input while it is in flight.
            start = wait.args[0]
            if _reads_input(fed_by[start] if start in fed_by else feeders(start)):
                node = wait.next
                while node is not first:
                    if writes_input(node):
                        first = node
                        break
                    node = node.next
            node = wait.next
            while node is not first and (node in issuing or node.target is WAIT):
                node = node.next
            if node is not first:
                first.prepend(wait)
                moved += 1
        # Issue early, in graph order; all-gathers not before the previous all-gather's wait.
        starts = [n for n in graph.nodes if collective_kind(n) is not None]
        previous_gather_wait = None
        for start in starts:
            order = {n: i for i, n in enumerate(graph.nodes)}
            members = feeders(start)
            members = _input_cone(members) + members
            member_set = set(members)
            anchor = None  # the node the members go right after
            for m in members:
                for arg in m.all_input_nodes:
                    if arg not in member_set and (anchor is None or order[arg] > order[anchor]):
                        anchor = arg
            # Never above a node that writes in place into a graph input, when it reads one.
            if _reads_input(members):
                for node in graph.nodes:
                    if node is start:
                        break
                    if writes_input(node) and (anchor is None or order[node] > order[anchor]):
                        anchor = node
            if collective_kind(start) == "all_gather":
                if previous_gather_wait is not None and (anchor is None or order[previous_gather_wait] > order[anchor]):
                    anchor = previous_gather_wait
                previous_gather_wait = next(iter(start.users))
            if anchor is None:
                anchor = max(graph.find_nodes(op="placeholder"), key=order.__getitem__, default=None)
            if anchor is None:
                continue
            # Members after the anchor move to right after it, in order (members before it stay).
            to_move = [m for m in members if order[m] > order[anchor]]
            if [order[m] for m in to_move] == list(range(order[anchor] + 1, order[anchor] + 1 + len(to_move))):
                continue  # already there
            for m in to_move:
                anchor.append(m)
                anchor = m
            moved += 1
        if moved:
            graph.lint()
            gm.recompile()
        return PassResult(gm, moved > 0)
