"""``bucketing``: merge the per-parameter collectives of a step into buckets, as DDP and FSDP2 do.

Expansion emits one collective per parameter: an all-reduce per gradient (DDP), an all-gather per
parameter and a reduce-scatter per gradient (FSDP). Each costs a launch and a latency; one collective
over the concatenated bytes costs one. This pass decides *which* collectives go together; the merge
itself (flatten, concatenate, one collective, split back) is torch Inductor's
(``torch._inductor.fx_passes.bucketing.merge_{all_reduce,all_gather,reduce_scatter}_bucket``).

Policy (the eager tools it follows):

* **Gradient all-reduces** (DDP): in the order the gradients are *produced* by backward, a first
  bucket of at most ``first_bucket_cap_mb`` (1 MiB) and then buckets of at most ``bucket_cap_mb``
  (25 MiB): ``torch.nn.parallel.DistributedDataParallel``'s ``bucket_cap_mb`` and its 1 MiB first
  bucket, so the first bucket can start while most of backward still runs.
* **Parameter all-gathers and gradient reduce-scatters** (FSDP): one bucket per block and region
  (forward, or each backward), as FSDP2 issues one all-gather and one reduce-scatter per
  ``fully_shard`` module. A block is the parameter FQN up to its first numeric component
  (``layers.3.attn.q.weight`` -> ``layers.3``: one element of an ``nn.ModuleList``/``Sequential``);
  parameters outside such lists (embeddings, final norm, head) form the root block. A block's members
  go together however far apart they are used (the root block's final norm and head with its
  embeddings, gathered at the start; their gradients reduced together at the end of backward), as
  FSDP2 gathers a module's parameters at its pre-forward and reduces them at its post-backward.
* **Results only the caller reads** (the returned loss's all-reduce: a ``Partial`` sum made
  ``Replicate`` for the caller): in a whole-step graph such an all-reduce joins the last gradient
  all-reduce bucket of its process group, reduce op and dtype instead of blocking on its own after
  the optimizer update (it waited after every in-place write). One collective less per step; its
  bytes (a scalar) ride along.
* Other collectives (the loss denominator, tensor-parallel activations) are left alone: they sit on
  the critical path, and merging them would delay the first.

Only collectives of the same kind, process group, reduce op and dtype are merged, and never two where
one's input depends on the other's output. The bucket's collective is placed where its last member was
(the ``overlap`` pass then moves it).
"""

from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import dataclass
from unittest import mock
from typing import Optional

import torch
import torch.fx as fx
from torch._inductor.fx_passes import bucketing as inductor_bucketing
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import PassError
from ..plans import block_of
from ..trace import backward_index
from .feeders import collective_kind, feeders, lays_out
from .manager import SpmdPass

__all__ = ["BucketCollectives", "block_of", "collective_kind"]

c10d = torch.ops._c10d_functional

_MERGE = {
    "all_reduce": inductor_bucketing.merge_all_reduce_bucket,
    "all_gather": inductor_bucketing.merge_all_gather_bucket,
    "reduce_scatter": inductor_bucketing.merge_reduce_scatter_bucket,
}

# Starts torch's merge functions take (a bucket already merged is an all_gather_into_tensor_out).
_MERGEABLE = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default}

@dataclass(frozen=True)
class _Candidate:
    node: fx.Node
    key: tuple
    order: int  # position the bucket order follows (gradient produced / parameter first needed)
    nbytes: int


def _nbytes(val) -> int:
    return val.numel() * val.element_size()


def _wait_of(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    if len(users) == 1 and users[0].target is c10d.wait_tensor.default:
        return users[0]
    return None


class BucketCollectives(SpmdPass):
    """Local pass: merge gradient and parameter collectives into buckets (see the module docstring).

    Args:
        bucket_cap_mb: largest all-reduce bucket in MiB (DDP's ``bucket_cap_mb``; default 25).
        first_bucket_cap_mb: largest first all-reduce bucket in MiB (DDP's; default 1).

    Requires ``meta["val"]`` on every collective and its input, and each collective waited by exactly
    one ``wait_tensor``. Ensures no more collectives than before. A second run finds nothing to merge
    only if every bucket is already as large as the caps allow; it never splits a bucket.
    """

    name = "bucketing"
    stage = "local"
    run_after = ("regather_for_backward",)

    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0):
        super().__init__()
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb

    def requires(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if collective_kind(node) is None:
                continue
            if "val" not in node.meta or "val" not in node.args[0].meta:
                raise PassError(f"pass 'bucketing' needs meta['val'] on {node.name} and its input")
            if _wait_of(node) is None:
                raise PassError(f"pass 'bucketing': {node.name} is not waited by exactly one wait_tensor")
        self._before = sum(collective_kind(n) is not None for n in gm.graph.nodes)

    def ensures(self, gm: fx.GraphModule) -> None:
        after = sum(collective_kind(n) is not None for n in gm.graph.nodes)
        if after > self._before:
            raise PassError(f"pass 'bucketing' grew the collectives of the step from {self._before} to {after}")

    def call(self, gm: fx.GraphModule) -> PassResult:
        buckets = self.buckets(gm)
        split = _is_split(gm)
        for kind, nodes in buckets:
            gradients = [n for n in nodes if n.meta.get("fqn") is not None]
            if split or kind == "all_gather":
                where = _placement(gm.graph, nodes)
            elif gradients:
                # Where the last gradient member was: a deferred result's all-reduce may sit after
                # the optimizer update, which reads the gradients.
                where = {"insert_before": gradients[-1].next}
            else:
                where = {}
            _merge(kind, gm.graph, nodes, **where)
        if buckets:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(buckets))

    def buckets(self, gm: fx.GraphModule) -> list[tuple[str, list[fx.Node]]]:
        """The buckets this pass would merge: ``(kind, collectives in graph order)``, two or more each."""
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        candidates: dict[str, list[_Candidate]] = {}
        deferred: list[fx.Node] = []
        for node in gm.graph.nodes:
            kind = collective_kind(node)
            fqn = node.meta.get("fqn")
            if kind == "all_reduce" and fqn is None and node.target in _MERGEABLE and _only_returned(node):
                deferred.append(node)
                continue
            if kind not in _MERGE or fqn is None or node.target not in _MERGEABLE:
                continue
            group = node.args[-1]
            val = node.meta["val"]
            region = backward_index(node) or 0
            if kind == "all_reduce":
                key = _all_reduce_key(node)
                position = order[node.args[0]]  # gradient produced
            elif kind == "reduce_scatter":
                key = (kind, group, node.args[1], val.dtype, region, block_of(fqn))
                position = order[node.args[0]]
            else:  # all_gather: in the order the parameters are first needed
                key = (kind, group, val.dtype, region, block_of(fqn))
                position = min(order[u] for u in _wait_of(node).users) if _wait_of(node).users else order[node]
            nbytes = max(_nbytes(val), _nbytes(node.args[0].meta["val"]))
            candidates.setdefault(kind, []).append(_Candidate(node, key, position, nbytes))
        if not _is_split(gm):
            # A deferred all-reduce goes right after the last gradient of its key (its input comes
            # from forward; nothing in the step reads its result).
            for node in deferred:
                key = _all_reduce_key(node)
                last = max((c.order for c in candidates.get("all_reduce", []) if c.key == key), default=None)
                if last is not None:
                    candidates["all_reduce"].append(_Candidate(node, key, last + 0.5, _nbytes(node.meta["val"])))

        result = []
        for kind, found in candidates.items():
            found.sort(key=lambda c: c.order)
            result.extend((kind, sorted(b, key=order.__getitem__)) for b in self._split(kind, found))
        return result

    def _split(self, kind: str, found: list[_Candidate]) -> list[list[fx.Node]]:
        """Buckets of candidates of one key, cut at dependencies.

        All-reduces: consecutive candidates (in the order gradients are produced), cut at the caps, as
        DDP fills its buckets. All-gathers and reduce-scatters: every candidate of a key (a block in a
        region) together, however far apart their uses are, as FSDP2 gathers a module's parameters
        at its pre-forward and reduces its gradients at its post-backward: the root block's final
        norm and head are gathered with its embeddings, and their gradients reduced with them.
        """
        if kind != "all_reduce":
            by_key: dict[tuple, list[_Candidate]] = {}
            for c in found:
                by_key.setdefault(c.key, []).append(c)
            found = [c for members in by_key.values() for c in members]
        buckets: list[list[fx.Node]] = []
        current: list[fx.Node] = []
        key, size, descendants, started = None, 0, set(), 0
        for c in found:
            cap = None
            if kind == "all_reduce":
                cap = int((self.first_bucket_cap_mb if started <= 1 else self.bucket_cap_mb) * 2**20)
            full = cap is not None and current and size + c.nbytes > cap
            if not current or c.key != key or c.node in descendants or full:
                if len(current) > 1:
                    buckets.append(current)
                current, key, size, descendants = [], c.key, 0, set()
                started += 1
            current.append(c.node)
            size += c.nbytes
            _add_descendants(c.node, descendants)
        if len(current) > 1:
            buckets.append(current)
        return buckets


def _merge(kind: str, graph: fx.Graph, nodes: list[fx.Node], **where) -> None:
    """torch's merge of ``nodes`` into one bucket, with the fake values of their users repaired once.

    After the merge each member's result is a view into the bucket (another storage offset), and
    torch re-runs the users under fake mode to repair their ``meta["val"]``
    (``_recompute_changed_user_metadata``). It starts from one entry per (member, user) pair, so an
    optimizer ``_foreach_*`` op that reads all N gradients of a bucket is re-run N times: O(N^2) fake
    dispatch, 5 of the 6 s of the local passes of an 8-layer GPT. Here the users' values are hidden
    while torch merges (it skips a node without one) and the repair runs once, from each user once.
    """
    users = list(dict.fromkeys(u for n in nodes for u in _wait_of(n).users))
    hidden = {u: u.meta.pop("val") for u in users if "val" in u.meta}
    try:
        # torch's merge calls its module's _populate_node_meta; the patch lasts for this merge only.
        patch = (
            mock.patch.object(inductor_bucketing, "_populate_node_meta", _populate_node_meta_once)
            if _TORCH_POPULATE_NODE_META is not None
            else contextlib.nullcontext()
        )
        with patch:
            _MERGE[kind](graph, nodes, **where)
    finally:
        for user, val in hidden.items():
            user.meta["val"] = val
    inductor_bucketing._recompute_changed_user_metadata(users)


# None in a torch without it (then torch's merge runs unchanged).
_TORCH_POPULATE_NODE_META = getattr(inductor_bucketing, "_populate_node_meta", None)


def _populate_node_meta_once(bucket_nodes: list[fx.Node], new_nodes: list[fx.Node]) -> None:
    """torch's ``_populate_node_meta``, computed once per bucket instead of once per new node.

    torch writes the same entries on every node the merge created (the first member's stack trace and
    module stack; the sources of all members; ``from_node``: one ``NodeSource`` per member, each of
    which formats the member's target and deep-copies its history). Nothing written depends on the
    new node, yet the cost is (new nodes) x (members): with 390 gradients in one bucket (a 32-layer
    GPT) that is 517,000 ``NodeSource`` objects, 6 of the 10 s of the local passes. Here torch's own
    function fills one stand-in node, and each new node gets shallow copies of its entries (its own
    lists, the same ``NodeSource`` records).
    """
    probe = types.SimpleNamespace(meta={})
    _TORCH_POPULATE_NODE_META(bucket_nodes, [probe])
    for node in new_nodes:
        node.meta.update({key: copy.copy(value) for key, value in probe.meta.items()})


def _all_reduce_key(node: fx.Node) -> tuple:
    """What two all-reduces must share to be merged: process group, reduce op, dtype."""
    return ("all_reduce", node.args[-1], node.args[1], node.meta["val"].dtype)


def _is_split(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` is the forward or backward part of a split joint graph (the torch.compile
    backend), not a whole step."""
    return getattr(gm.meta.get("spmd_pass_context"), "split_graph", False)


def _only_returned(node: fx.Node) -> bool:
    """Whether the collective's result goes only to the graph's output (its wait's users)."""
    wait = _wait_of(node)
    return wait is not None and bool(wait.users) and all(u.op == "output" for u in wait.users)


def _placement(graph: fx.Graph, nodes: list[fx.Node]) -> dict:
    """Where a merged all-gather (or any bucket of a split forward or backward graph) goes.

    torch's default is where the last member was, after which it sorts the region in between. When a
    member's result is used before the last member (the root block's embeddings, gathered with its
    final norm and head; in the backward graph split from a joint graph, re-gathered parameters whose
    uses interleave with the gathers), that sort can leave a use before the bucket's output; the
    bucket then goes where its first member was, with the nodes that exist only to feed its members
    (:func:`~.feeders.feeders`) moved there, when everything else they read comes before it (a
    parameter, or the parameter under the dtype cast torch's merge takes into the bucket; buckets
    are cut at dependencies).

    The decision looks through nodes that differ between ranks: expansion pads an unevenly sharded
    parameter only on the ranks whose shard is short, and narrows a reduce-scatter's result only on
    those, so a rule that read the padding's position would put the bucket elsewhere on those ranks,
    and the ranks would issue their collectives in different orders (a mismatch gloo reports as
    "Received data size doesn't match expected size", or memory corruption).
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(order[n] for n in nodes)
    used_early = any(order[u] < last for n in nodes for u in _uses(_wait_of(n)))
    first = min(nodes, key=order.__getitem__)
    chains = [f for n in nodes for f in feeders(n) if f is not n]
    inside = set(chains) | set(nodes)
    reads = [a for n in inside for a in _bucket_inputs(n) if a not in inside]
    if not used_early or not all(order[a] < order[first] for a in reads):
        return {}
    for node in sorted(chains, key=order.__getitem__):
        first.prepend(node)
    return {"insert_before": first}


def _uses(node: fx.Node) -> list[fx.Node]:
    """The nodes that compute with ``node``'s value: its users, looking through views and copies that
    only lay it out (a narrow of a padded result, present on some ranks only)."""
    found, stack, seen = [], list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and lays_out(user) and collective_kind(user) is None:
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _bucket_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes a collective's bucket reads for it: its inputs, or those of the dtype cast before an
    all-gather, which torch's merge moves into the bucket."""
    if collective_kind(node) is not None and inductor_bucketing.has_mergeable_all_gather_convert_dtype(node):
        return node.args[0].all_input_nodes
    return node.all_input_nodes


def _add_descendants(node: fx.Node, seen: set[fx.Node]) -> None:
    """Add the nodes that depend on ``node`` to ``seen``, which is closed under users: the walk stops
    at a node already there, so a bucket's members cost one pass over the graph together."""
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
