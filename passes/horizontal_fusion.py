"""``horizontal_fusion``: per-parameter scalar arithmetic of the optimizer as one op over a vector.

torch's optimizers keep one ``step`` tensor per parameter, and their traceable paths compute each
parameter's bias corrections from it with 0-d tensor ops: for AdamW (``foreach=True``, torch 2.13,
``_multi_tensor_adam``) ``1 - beta1 ** step``, ``1 - beta2 ** step``, ``lr / bc1 * -1``,
``bc2 ** 0.5`` ... for every parameter, about ten ops each: 22% of the nodes of the demo GPT's step,
and as many tiny kernels for Inductor to generate and launch. These chains run in lockstep (one list
comprehension per op) over the elements of a ``_foreach_*`` result, so the same op applies to N
operands that differ only in their lane. This global pass rewrites each such group of N ops as the
op on the N operands stacked into one vector (``aten.stack``), and reads lanes back with
``aten.select`` only where something else needs one lane (a ``stack`` of the lanes in order becomes
the vector itself). Horizontal fusion in the sense of Inductor's combo kernels and XLA's horizontal
loop fusion, done on the graph before propagation so that every later stage sees the smaller graph.

What fuses (everything else is left alone):

* **lanes**: the ``getitem`` results of a ``_foreach_*`` op, and the results of a fused group;
* **a group**: N elementwise ops (``torch.Tag.pointwise``, or ``_to_copy`` with only a ``dtype``),
  one per lane of one lane source, with the same target, the same non-lane arguments (constants,
  hyperparameters, nodes shared by all N) and the lane operand(s) in the same positions, each
  result a 0-d tensor of one dtype. An op with two tensor operands needs them of one dtype (a 0-d
  tensor does not promote a 1-d one the way it promotes another 0-d tensor);
* **in place**: only where no lane's result is used before the last member of its group is computed
  (the foreach paths compute a whole list before using it); the per-parameter for-loops of
  ``foreach=False`` interleave the lanes and are not fused. Nothing is reordered.

Values: each lane computes the same elementwise function of the same inputs as before; only the
kernel's loop shape changes (a vectorized loop over N elements instead of N scalar calls), which can
move float64 results by an ulp.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import PassError
from .manager import SpmdPass

__all__ = ["HorizontalFusion", "horizontal_fusion"]

aten = torch.ops.aten

_MIN_LANES = 2


@dataclass
class _Group:
    """N nodes computing one op on the N lanes of ``sources`` (fused groups), or the N ``getitem``
    results of a ``_foreach_*`` op (``seed``)."""

    lanes: dict[int, fx.Node]
    sources: tuple[int, ...] = ()  # ids of the groups whose lanes the members read
    positions: tuple = ()  # per argument: ("lane", group id) or ("shared", value)
    seed: Optional[fx.Node] = None
    vector: Optional[fx.Node] = None
    valid: bool = True

    @property
    def members(self) -> list[fx.Node]:
        return [self.lanes[i] for i in sorted(self.lanes)]


def _scalar_tensor(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _elementwise(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype"}
    tags = target.tags
    # A random op drawn for N lanes at once would consume the generator differently.
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and not target._schema.is_mutable


def _seeds(nodes: list[fx.Node], min_lanes: int) -> list[_Group]:
    """One group per ``_foreach_*`` op whose result is only read lane by lane, each lane a 0-d tensor."""
    groups = []
    for node in nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target.name().startswith("aten::_foreach_"):
            continue
        getitems = list(node.users)
        if len(getitems) < min_lanes or any(u.target is not operator.getitem for u in getitems):
            continue
        lanes = {g.args[1]: g for g in getitems}
        if sorted(lanes) != list(range(len(getitems))) or not all(map(_scalar_tensor, getitems)):
            continue
        groups.append(_Group(lanes, seed=node))
    return groups


def _pattern(node: fx.Node, lane_of: dict) -> Optional[tuple[int, tuple]]:
    """``(lane, positions)`` of an elementwise 0-d op reading at least one lane, or None."""
    positions, lane = [], None
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg in lane_of:
            gid, i = lane_of[arg]
            if lane not in (None, i):
                return None
            lane = i
            positions.append(("lane", gid))
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg):
            return None
        else:
            positions.append(("shared", arg))
    if lane is None:
        return None
    return lane, tuple(positions)


def _same_dtype_operands(node: fx.Node) -> bool:
    """Tensor operands all 0-d, and of one dtype when there are two or more."""
    vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    return all(t.dim() == 0 for t in tensors) and len({t.dtype for t in tensors}) <= 1


def horizontal_fusion(gm: fx.GraphModule, min_lanes: int = _MIN_LANES) -> int:
    """Fuse the lockstep 0-d op chains of ``gm`` (see the module docstring). Returns the number of
    groups fused; ``gm`` is changed in place. Idempotent: a second run finds no group.

    Raises:
        PassError: the graph has no fake values (``meta["val"]``) to build the fused nodes' from.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups = _seeds(nodes, min_lanes)
    lane_of: dict[fx.Node, tuple[int, int]] = {}
    for gid, group in enumerate(groups):
        for i, g in group.lanes.items():
            lane_of[g] = (gid, i)
    group_of: dict[tuple, int] = {}
    for node in nodes:
        if not _elementwise(node) or not _scalar_tensor(node):
            continue
        found = _pattern(node, lane_of)
        if found is None:
            continue
        lane, positions = found
        key = (node.target, positions, tuple(sorted(node.kwargs.items(), key=lambda kv: kv[0])), node.meta["val"].dtype)
        try:
            gid = group_of.get(key)
        except TypeError:  # an unhashable constant argument
            continue
        if gid is None:
            sources = tuple(dict.fromkeys(g for kind, g in positions if kind == "lane"))
            groups.append(_Group({}, sources=sources, positions=positions))
            gid = group_of[key] = len(groups) - 1
        if lane in groups[gid].lanes:
            continue  # a second node of the same pattern in one lane: left alone
        groups[gid].lanes[lane] = node
        lane_of[node] = (gid, lane)
    if not any(g.seed is None for g in groups):
        return 0
    fake_mode = detect_fake_mode([n.meta.get("val") for n in nodes if n.op == "placeholder"])
    if fake_mode is None:
        raise PassError("pass 'horizontal_fusion' needs fake values (meta['val']) on the graph's inputs")

    _settle_validity(groups, order, min_lanes)
    shape_env = fake_mode.shape_env
    guards_before = len(shape_env.guards) if shape_env is not None else 0
    fused = 0
    for group in groups:  # in the order groups were first seen: sources before their users
        if group.seed is None and group.valid:
            fused += _fuse(graph, group, groups, fake_mode)
    if shape_env is not None and len(shape_env.guards) > guards_before:
        # The step's hyperparameter guards were taken when it was traced; a guard added now would
        # not be checked on later calls. Elementwise ops on vectors guard nothing their 0-d forms
        # did not; should one ever do, refuse loudly rather than risk a stale graph.
        raise PassError(
            f"pass 'horizontal_fusion' added a guard on the step's symbols ({shape_env.guards[-1].expr}); "
            f"compile with passes=default_passes(disable=['horizontal_fusion'])"
        )
    if fused:
        _erase_unused(graph, groups)
        graph.lint()
        gm.recompile()
    return fused


def _settle_validity(groups: list[_Group], order: dict, min_lanes: int) -> None:
    """Mark the groups that fuse (``valid``): the largest set where each group is complete, reads
    only fusing sources, and every use of a member before the group's last member is a member of a
    fusing group (the lanes of a list comprehension interleave: ``1 - beta ** s`` computes ``pow``
    then ``rsub`` per lane; fused, the rsub of every lane reads the fused pow). The vector then goes
    right after the last member, and no remaining node is moved."""
    for group in groups:
        group.valid = group.seed is not None or _complete(group, groups, order, min_lanes)
    owner = {m: gid for gid, g in enumerate(groups) if g.seed is None for m in g.lanes.values()}
    changed = True
    while changed:
        changed = False
        for gid, group in enumerate(groups):
            if group.seed is not None or not group.valid:
                continue
            last = max(order[m] for m in group.lanes.values())
            early = [u for m in group.lanes.values() for u in m.users if order[u] <= last]
            if not all(groups[s].valid for s in group.sources) or not all(
                u in owner and groups[owner[u]].valid and gid in groups[owner[u]].sources for u in early
            ):
                group.valid = False
                changed = True


def _complete(group: _Group, groups: list[_Group], order: dict, min_lanes: int) -> bool:
    n_lanes = {len(groups[s].lanes) for s in group.sources}
    if len(n_lanes) != 1 or sorted(group.lanes) != list(range(n_lanes.pop())) or len(group.lanes) < min_lanes:
        return False
    if not all(_same_dtype_operands(m) for m in group.lanes.values()):
        return False
    # A foreach source's lanes are stacked after its last lane, which must precede the last member.
    last = max(order[m] for m in group.lanes.values())
    return all(max(order[g] for g in groups[s].lanes.values()) < last for s in group.sources if groups[s].seed is not None)


def _with_val(node: fx.Node, like: fx.Node, fake_mode, fn, *args, **kwargs) -> fx.Node:
    with fake_mode:
        node.meta["val"] = fn(*args, **kwargs)
    for key in ("stack_trace", "custom"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _vector_of(graph: fx.Graph, source: _Group, fake_mode) -> fx.Node:
    """The source's lanes as one vector: a fused group's node, or else ``stack`` of its lanes (a
    foreach's getitems; the members of a group whose fusion failed)."""
    if source.vector is None:
        members = source.members
        with graph.inserting_after(_last(members)):
            stacked = graph.call_function(aten.stack.default, (members, 0))
        source.vector = _with_val(stacked, members[0], fake_mode, torch.stack, [m.meta["val"] for m in members], 0)
    return source.vector


def _last(nodes: list[fx.Node]) -> fx.Node:
    """The node of ``nodes`` that comes last in its graph."""
    remaining = set(nodes)
    last = None
    for n in nodes[0].graph.nodes:
        if n in remaining:
            last = n
            remaining.discard(n)
            if not remaining:
                break
    return last


def _fuse(graph: fx.Graph, group: _Group, groups: list[_Group], fake_mode) -> bool:
    """Replace the group by one op on vectors; False (nothing changed) if its result is not one
    value per lane after all."""
    members = group.members
    first = members[0]
    args, vals = [], []
    for kind, value in group.positions:
        if kind == "lane":
            vector = _vector_of(graph, groups[value], fake_mode)
            args.append(vector)
            vals.append(vector.meta["val"])
        else:
            args.append(value)
            vals.append(value.meta["val"] if isinstance(value, fx.Node) else value)
    with graph.inserting_after(_last(members)):
        vector = graph.call_function(first.target, tuple(args), dict(first.kwargs))
    _with_val(vector, first, fake_mode, first.target, *vals, **first.kwargs)
    if (tuple(vector.meta["val"].shape), vector.meta["val"].dtype) != ((len(members),), first.meta["val"].dtype):
        graph.erase_node(vector)
        group.valid = False
        return False
    group.vector = vector
    selects = []
    with graph.inserting_after(vector):
        for i in reversed(range(len(members))):
            select = graph.call_function(aten.select.int, (vector, 0, i))
            selects.append(_with_val(select, first, fake_mode, torch.select, vector.meta["val"], 0, i))
    selects.reverse()
    for member, select in zip(members, selects):
        member.replace_all_uses_with(select)
        graph.erase_node(member)
    # A stack of all lanes in order (the optimizers' _stack_if_compiling) is the vector itself.
    for user in list(selects[0].users):
        if user.target is aten.stack.default and list(user.args[0]) == selects and (user.args[1:] or (0,))[0] == 0:
            user.replace_all_uses_with(vector)
            graph.erase_node(user)
    return True


def _erase_unused(graph: fx.Graph, groups: list[_Group]) -> None:
    """Erase the lane reads nothing uses, then the vectors nothing uses (a foreach result's stack
    whose only consumer did not fuse after all)."""
    for group in groups:
        if group.vector is not None and group.seed is None:
            for user in list(group.vector.users):
                if user.target is aten.select.int and not user.users:
                    graph.erase_node(user)
    for group in reversed(groups):
        if group.vector is not None and not group.vector.users:
            graph.erase_node(group.vector)


class HorizontalFusion(SpmdPass):
    """Global pass: the optimizer's per-parameter 0-d arithmetic as ops over vectors (see the module
    docstring).

    Requires fake values (``meta["val"]``) on the traced graph. Ensures no more nodes than before.
    Idempotent: a second run finds nothing to fuse.
    """

    name = "horizontal_fusion"
    stage = "global"

    def __init__(self, min_lanes: int = _MIN_LANES):
        super().__init__()
        self.min_lanes = min_lanes

    def requires(self, gm: fx.GraphModule) -> None:
        self._before = len(gm.graph.nodes)

    def call(self, gm: fx.GraphModule) -> PassResult:
        return PassResult(gm, horizontal_fusion(gm, self.min_lanes) > 0)

    def ensures(self, gm: fx.GraphModule) -> None:
        if len(gm.graph.nodes) > self._before:
            raise PassError(f"pass 'horizontal_fusion' grew the graph from {self._before} to {len(gm.graph.nodes)} nodes")
