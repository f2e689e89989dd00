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
only the batch feeds would then block right after the forward, at the start of the rest: DDP's loss
denominator (the count of targets not ignored, summed over the ranks), which the ``overlap`` pass
issued at the top of the graph to fly under the forward. Its value is an integer known before
anything runs, so it travels in the check's all-gather instead (:func:`folded_all_reduce`): each rank
computes its count first (a few ops on the targets), sends it in its check row, and sums the rows.
:class:`PrologueRunner` runs the parts: ``run(args, start)`` computes the count, starts the check,
runs the prologue, takes the check's verdict (and the sum), then runs the rest; ``runner(*args)``
(a call that checked before, on the full path) runs them back to back with the count all-reduced
as a blocking collective.

Measured on the demo GPT's DDP step (2 gloo ranks on 2 CPU cores): the check's wait after the prologue
has a median of 0.03 ms (before the graph it blocked a median of ~0.3 ms, p90 ~3 ms). Split and unsplit
steps compiled in one process and called alternately (300 rounds, 3 runs): median 11.01-11.55 vs
11.56-11.82 ms, mean 11.52-11.67 vs 12.02-12.33, p90 15.4-15.6 vs 16.1-17.5; with a barrier before
every call (the ranks start together: no skew for the forward to absorb) equal within noise.
``bench/step_time.py`` (a barrier before every step): spmd DDP / torch DDP 0.89 and 0.93 in 2 runs; without
the split 0.93-1.01 in 7 runs the same day. :func:`~spmd_expand.pipeline.compile_step` splits graphs on CPU
meshes only (unmeasured on GPUs, where a collective's wait does not block the host but the verdict does).

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
import torch.distributed as dist
import torch.fx as fx

from .errors import CollectiveError, first_line
from .graph_stats import COLLECTIVES
from .passes.feeders import WAIT, aliases_input
from .rng import draws_random
from .watch import is_communication_failure

__all__ = ["PrologueRunner", "Split", "folded_all_reduce", "prologue_nodes", "split_prologue"]

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
        rest: takes the original graph's inputs, then the prologue's results, then (with ``count``) the
            folded all-reduce's result; returns the original graph's outputs.
        carried: how many values the prologue returns.
        count: with a folded all-reduce (:func:`folded_all_reduce`), the graph computing its local
            integer from the inputs (returns it, a one-element tensor), else None.
        count_group: the folded all-reduce's process group name.
        count_node: the folded all-reduce node's name (for errors).
    """

    prologue: fx.GraphModule
    rest: fx.GraphModule
    carried: int
    count: Optional[fx.GraphModule] = None
    count_group: Optional[str] = None
    count_node: str = ""


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


def folded_all_reduce(graph: fx.Graph, inside: set, check_ranks: Optional[frozenset]) -> Optional[tuple]:
    """The all-reduce whose sum can travel in the rank check's all-gather instead:
    ``(all_reduce, wait, count, dtype)``, or None.

    DDP's loss denominator: the count of targets not ignored, an integer the batch alone decides
    (``sum(ne(targets, -100))``), summed over the data-parallel ranks, cast to the loss's dtype
    (``trace._nll_loss_mean_as_sum``). It is the graph's first collective, and once the check's verdict
    comes after the forward it would block right there. Its value is known before anything runs, so
    each rank sends its count in its check row and sums the rows. Folded: the first all-reduce (sum) in
    graph order of a one-element integer tensor (or its cast: ``dtype``) computed by the prologue from
    the inputs without random draws, over exactly the check's ranks (``check_ranks``; a 2-D mesh's
    data-parallel dim is a subgroup: not folded). The sum of integers is exact, in any order.
    """
    if not check_ranks:
        return None
    for node in graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default):
        x, op, group = node.args[:3]
        if op != "sum" or not isinstance(x, fx.Node) or x not in inside or len(node.users) != 1:
            continue
        wait = next(iter(node.users))
        dtype = None
        count = x
        if x.target is torch.ops.aten._to_copy.default and set(x.kwargs) == {"dtype"}:
            count, dtype = x.args[0], x.kwargs["dtype"]
        val = count.meta.get("val")
        if (
            wait.target is not WAIT
            or not isinstance(val, torch.Tensor)
            or val.numel() != 1
            or val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool
            or not all(n.op == "call_function" and _functional(n) and not draws_random(n) for n in _cone(count))
        ):
            continue
        try:
            ranks = frozenset(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group)))
        except (RuntimeError, ValueError, KeyError):
            continue
        if ranks == check_ranks:
            return node, wait, count, dtype
    return None


def _wrapped(total: int, dtype: torch.dtype) -> int:
    """``total`` as an integer tensor of ``dtype`` holds it after an all-reduce: modulo 2**bits, in
    two's complement (an int8 count of 128 rows on each of 2 ranks sums to 0, as one device's 256 does)."""
    info = torch.iinfo(dtype)
    total %= 1 << info.bits
    return total - (1 << info.bits) if info.min < 0 and total > info.max else total


def split_prologue(gm: fx.GraphModule, check_ranks: Optional[frozenset] = None) -> Optional[Split]:
    """Cut ``gm`` into a prologue and the rest (module docstring), or None when the prologue would
    hold no matrix product, convolution or attention (nothing for the check to hide under) or the
    rest would need none of it. ``check_ranks``: the ranks of the check's all-gather, for
    :func:`folded_all_reduce`."""
    nodes = prologue_nodes(gm.graph)
    if not any(_computes(n) for n in nodes):
        return None
    inside = set(nodes)
    folded = folded_all_reduce(gm.graph, inside, check_ranks)
    skipped = {folded[0]} if folded else set()
    # Views of inputs are computed again in the rest; everything else the rest reads is passed across.
    again = {n for n in nodes if aliases_input(n)}
    carried = [n for n in nodes if n not in again and any(u not in inside and u not in skipped for u in n.users)]
    if not carried:
        return None
    rest = fx.Graph()
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = rest.node_copy(node, env.__getitem__)
    for node in carried:
        env[node] = rest.placeholder(f"prologue_{node.name}")
        env[node].meta.update(node.meta)
    count = None
    if folded:
        all_reduce, wait, count_node, dtype = folded
        total = rest.placeholder(f"sum_{count_node.name}")
        total.meta.update(count_node.meta)
        env[wait] = rest.call_function(torch.ops.aten._to_copy.default, (total,), {"dtype": dtype}) if dtype else total
        env[wait].meta.update(wait.meta)
        count = _extract(gm, _cone(count_node), [count_node])

    def copied(node: fx.Node) -> fx.Node:
        if node not in env:  # a view of an input (or a getattr): made again in the rest
            env[node] = rest.node_copy(node, copied)
        return env[node]

    for node in gm.graph.nodes:
        if node.op != "placeholder" and node not in inside and node not in skipped and node not in env:
            env[node] = rest.node_copy(node, copied)
    return Split(
        _extract(gm, inside, carried), _module(gm, rest), len(carried), count,
        folded[0].args[2] if folded else None,
        folded[0].name if folded else "",
    )


def _cone(node: fx.Node) -> set:
    """``node`` and every node it is computed from, graph inputs (placeholders, attributes) left out."""
    cone, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in cone and n.op not in ("placeholder", "get_attr"):
            cone.add(n)
            stack.extend(n.all_input_nodes)
    return cone


def _extract(gm: fx.GraphModule, members: set, outputs: Sequence[fx.Node]) -> fx.GraphModule:
    """A graph of ``gm``'s inputs and its ``members`` (closed under their arguments), in ``gm``'s
    order, returning ``outputs`` as a tuple."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or node in members:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return _module(gm, graph)


def _module(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    # No dead code elimination: a random op nobody reads still draws, in the unsplit graph too.
    return fx.GraphModule(gm, graph)


class PrologueRunner:
    """Runs a :class:`Split`: ``runner(*args)`` like the unsplit graph's runner;
    ``runner.run(args, start)`` starts the rank check before the prologue and takes its verdict after.

    ``prologue``: the lowered prologue. ``lower_rest(examples)``: lowers the rest for example inputs
    (the original inputs, the prologue's results, the folded sum); called on the first call.
    ``count``: the split's ``count`` graph (run as is: a few ops on the batch), ``count_group`` its
    all-reduce's group.
    """

    def __init__(
        self,
        prologue: Callable[..., Sequence[torch.Tensor]],
        lower_rest: Callable[[list], Callable[..., list]],
        count: Optional[Callable[..., Sequence[torch.Tensor]]] = None,
        count_group: Optional[str] = None,
        count_node: str = "",
    ):
        self.prologue = prologue
        self._lower_rest = lower_rest
        self.count, self.count_group, self.count_node = count, count_group, count_node
        self.rest: Optional[Callable[..., list]] = None
        self._copied: list[int] = []  # results that share an input's storage: copied before the rest

    def __call__(self, *args: Any) -> list:
        return self.run(args, None)

    def run(self, args: Sequence[Any], start: Optional[Callable[[Optional[int]], Optional[Callable[[], Optional[int]]]]]) -> list:
        """Run the step. ``start(count)`` (None: no check) issues the rank check with this rank's
        folded count (None without one) and returns its verdict, a callable that waits, raises when the
        ranks differ, and returns the sum of every rank's count, or None where the ranks must
        all-reduce it themselves (a rank took the full path: it sent no count); None: nothing to wait."""
        count = None
        try:
            if self.count is not None:
                count = self.count(*args)[0]
        finally:
            # Also when the count failed: the peers still get this rank's check.
            finish = start(int(count) if count is not None else None) if start is not None else None
        carried = list(self.prologue(*args))
        first = self.rest is None
        if first:
            self._copied = _sharing_storage(args, carried)
        for i in self._copied:
            carried[i] = carried[i].clone()
        total = finish() if finish is not None else None
        if count is not None:
            carried.append(count.new_full(count.shape, _wrapped(total, count.dtype)) if total is not None else self._all_reduce(count))
        if first:
            self.rest = self._lower_rest([*args, *carried])
        return self.rest(*args, *carried)

    def _all_reduce(self, count: torch.Tensor) -> torch.Tensor:
        """The folded all-reduce, run as a blocking collective (a call without the check's sum)."""
        total = count.clone()
        try:
            dist.all_reduce(total, group=dist.distributed_c10d._resolve_process_group(self.count_group))
        except Exception as e:
            if not is_communication_failure(e):
                raise
            raise CollectiveError(
                f"rank {dist.get_rank()}: the all-reduce {self.count_node!r} of the compiled step (a count the batch "
                f"decides, e.g. the loss's targets not ignored) failed: {first_line(e)}. Another rank failed or "
                f"stopped calling the step (look for its error first)"
            ) from e
        return total


def _sharing_storage(args: Sequence[Any], carried: Sequence[torch.Tensor]) -> list[int]:
    """Indices of ``carried`` tensors whose storage an input also has. (Carried tensors may share
    storage with each other, views of one buffer: the rest only reads them.)"""
    inputs = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
    return [i for i, t in enumerate(carried) if _storage(t) in inputs]


def _storage(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())
