"""The prologue of a per-rank graph: the computation that may run while the per-call rank check is in flight.

Every call of a compiled step first checks that the ranks agree (batch shapes, arguments,
hyperparameter values, graph: :func:`~spmd_expand.guards.check_batch`), one all-gather of a few
integers. Done before the graph, it blocks: each rank waits for the slowest to arrive and for the
round trip, with nothing to do (on the demo GPT's DDP step on 2 CPU ranks, 1-3 ms of a ~10 ms step).
The check only has to come before the first thing another rank could see or the step cannot take
back: the first collective, the first write into an input (a parameter, a buffer, an optimizer
state). What comes before that is this rank's own computation from its inputs (under DDP, the whole
forward), and it can run while the check's all-gather is in flight.

:func:`split_prologue` cuts the graph in two: the **prologue**, the ops that neither communicate nor
write nor depend on a collective, up to the first write into anything; and the **rest**, everything
else in the original order, which takes the prologue's results as extra inputs. A collective that
only the batch feeds (DDP's loss denominator, which the ``overlap`` pass issues at the top of the
graph) moves to the start of the rest, where it still flies under the backward. :class:`PrologueRunner`
runs the two: ``run(args, between)`` calls ``between`` (wait for the check's all-gather and compare)
after the prologue and before the rest; ``runner(*args)`` runs both back to back.

What keeps the results those of the unsplit graph:

* the prologue holds only functional ATen ops (no collective, no wait, no in-place or ``out=`` op) and
  no node after the graph's first in-place op, so it reads the inputs as the unsplit graph read them;
* random draws keep their order: once a random op lands in the rest, every later one does too;
* a prologue value that is a view of an input (a weight's transpose that backward reads again) is not
  passed across but computed again in the rest (free), so the rest never holds a second name for an
  input it writes; and a value the compiled prologue returns *as* an input's storage anyway (Inductor
  removes no-op copies) is copied before the rest runs (checked on the first call; the aliasing of
  compiled code does not change between calls);
* the rest is compiled on the first call, for the strides the compiled prologue really returns.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .graph_stats import COLLECTIVES
from .passes.feeders import WAIT, aliases_input
from .rng import draws_random

__all__ = ["Split", "split_prologue", "PrologueRunner"]

# Ops whose presence in the prologue makes it worth running early: the check's round trip hides
# under them (a prologue of layout ops only, FSDP's flatten of the first bucket, hides nothing).
_COMPUTE = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution"})


def _computes(node: fx.Node) -> bool:
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
    return name in _COMPUTE or name.startswith("_scaled_dot_product")


@dataclass
class Split:
    """A graph cut by :func:`split_prologue`.

    Attributes:
        prologue: takes the original graph's inputs, returns the values the rest needs.
        rest: takes the original graph's inputs and then the prologue's results, returns the original
            graph's outputs.
        carried: how many values the prologue returns.
    """

    prologue: fx.GraphModule
    rest: fx.GraphModule
    carried: int


def _functional(node: fx.Node) -> bool:
    """A node the prologue may hold: a functional ATen op that is no collective or wait, or a
    ``getitem`` of one's results."""
    if node.target is operator.getitem:
        return True
    target = node.target
    return (
        isinstance(target, torch._ops.OpOverload)
        and not target._schema.is_mutable
        and target not in COLLECTIVES
        and target is not WAIT
    )


def prologue_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of ``graph`` that go to the prologue (see the module docstring), in graph order."""
    inside: set[fx.Node] = set()
    random_in_rest = False
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op != "call_function":
            break
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            break  # the first write: nothing after it reads the inputs as before
        joins = _functional(node) and all(a in inside or a.op in ("placeholder", "get_attr") for a in node.all_input_nodes)
        if draws_random(node):
            joins = joins and not random_in_rest
            random_in_rest = random_in_rest or not joins
        if joins:
            inside.add(node)
    # A multi-output op's results cross as tensors: its getitems join it (pure, they read only it).
    inside |= {u for n in inside for u in n.users if u.target is operator.getitem}
    return [n for n in graph.nodes if n in inside]


def split_prologue(gm: fx.GraphModule) -> Optional[Split]:
    """Cut ``gm`` into a prologue and the rest (module docstring), or None when the prologue would
    hold no matrix product, convolution or attention (nothing for the check to hide under) or the
    rest would need none of it."""
    nodes = prologue_nodes(gm.graph)
    if not any(_computes(n) for n in nodes):
        return None
    inside = set(nodes)
    # Views of inputs are computed again in the rest; everything else the rest reads is passed across.
    again = {n for n in nodes if aliases_input(n)}
    carried = [n for n in nodes if n not in again and any(u not in inside for u in n.users)]
    if not carried:
        return None
    prologue = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or node in inside:
            env[node] = prologue.node_copy(node, env.__getitem__)
    prologue.output(tuple(env[n] for n in carried))

    rest = fx.Graph()
    env = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = rest.node_copy(node, env.__getitem__)
    for node in carried:
        env[node] = rest.placeholder(f"prologue_{node.name}")
        env[node].meta.update(node.meta)

    def copied(node: fx.Node) -> fx.Node:
        if node not in env:  # a view of an input (or a getattr): made again in the rest
            env[node] = rest.node_copy(node, copied)
        return env[node]

    for node in gm.graph.nodes:
        if node.op != "placeholder" and node not in inside:
            env[node] = rest.node_copy(node, copied)
    return Split(_module(gm, prologue), _module(gm, rest), len(carried))


def _module(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    # No dead code elimination: a random op nobody reads still draws, in the unsplit graph too.
    return fx.GraphModule(gm, graph)


class PrologueRunner:
    """Runs a :class:`Split`: ``runner(*args)`` like the unsplit graph's runner;
    ``runner.run(args, between)`` calls ``between()`` after the prologue, before the rest.

    ``prologue``: the lowered prologue. ``lower_rest(examples)``: lowers the rest for example inputs
    (the original inputs, then the prologue's results); called on the first call.
    """

    def __init__(self, prologue: Callable[..., Sequence[torch.Tensor]], lower_rest: Callable[[list], Callable[..., list]]):
        self.prologue = prologue
        self._lower_rest = lower_rest
        self.rest: Optional[Callable[..., list]] = None
        self._copied: list[int] = []  # results that share an input's storage: copied before the rest

    def __call__(self, *args: Any) -> list:
        return self.run(args, None)

    def run(self, args: Sequence[Any], between: Optional[Callable[[], None]]) -> list:
        carried = list(self.prologue(*args))
        first = self.rest is None
        if first:
            self._copied = _sharing_storage(args, carried)
        for i in self._copied:
            carried[i] = carried[i].clone()
        if between is not None:
            between()
        if first:
            self.rest = self._lower_rest([*args, *carried])
        return self.rest(*args, *carried)


def _sharing_storage(args: Sequence[Any], carried: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``carried`` tensors whose storage an input or an earlier carried tensor also has."""
    seen = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
    shared = []
    for i, t in enumerate(carried):
        key = _storage(t)
        if key in seen:
            shared.append(i)
        seen.add(key)
    return shared


def _storage(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())
