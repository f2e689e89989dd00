"""Every rank compiles the same program: checked across ranks before the program's first collective.

An SPMD program is one program run by every rank; when ranks disagree (a model built with another
width on one rank, rank-dependent code in the step), their collectives no longer match and the job
hangs, aborts inside the communication library, or computes a silently wrong result. spmd_expand
checks agreement where a divergence would first matter:

* before the first conversion of a model's state (``spmd.compile``'s first call, ``spmd.parallelize``,
  ``CompiledStep.prepare``): parameter names, global shapes, dtypes, ``requires_grad`` and placements,
  and buffers — the broadcast of replicated parameters is the first collective;
* at every compilation, after propagation and before expansion: the global graph, node by node (op,
  arguments and constants, global shapes and dtypes, placements), from which expansion derives the
  collectives deterministically;
* at every compilation, after the local passes: the collectives of this rank's graph, in the order it
  issues them (kind, mesh dim, reduce op, input dtype and shape; no shapes on an N-D mesh). Ranks'
  local graphs may differ (an uneven shard is padded on the ranks whose piece is short), but their
  collectives may not; a difference here is a bug of spmd_expand's expansion or passes, reported
  instead of a collective mismatch (a hang, an abort inside gloo/NCCL, or memory corruption).

Each check is one digest per rank exchanged through the default process group's store (the first rank
of the mesh publishes its digest, every rank compares with it; O(W) store operations), so a rank that
never arrives makes the others fail after :data:`timeout` instead of hanging. On a mismatch every
rank raises :class:`~spmd_expand.errors.DivergenceError` naming the ranks that differ and the first
difference, with each rank's source line.

Follows the purpose of torch's ``torch/_inductor/fx_passes/spmd_check.py`` (a structural hash of the
graph compared across ranks), through the store instead of a collective so that it cannot hang.
Skipped when the default process group is a fake one (``init_process_group("fake")``) or the mesh has
one rank.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .errors import DivergenceError, user_source_line
from .graph_stats import COLLECTIVES

__all__ = ["timeout", "check_ranks_agree", "graph_entries", "collective_entries", "state_entries"]

#: Seconds a rank waits for the others at a check; None: the default store's timeout (the
#: ``timeout`` given to ``init_process_group``).
timeout: Optional[float] = None

# One serial per check, in the order the checks run: the same on every rank of an SPMD program (a
# rank that compiles an extra graph waits on a serial the others never publish, and times out).
_serials = itertools.count()
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return "" if value is None else type(value).__name__


def graph_entries(gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    """One line per node of a global graph (op, arguments and constants, value, placements), and its
    source line."""
    entries, sources = [], []
    for node in gm.graph.nodes:
        # fx's own walk over node arguments (C++): 3-4x faster than pytree's here, the same text.
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
        sharding = node.meta.get("spmd")
        output = getattr(sharding, "output", None)
        placements = getattr(output, "placements", None)
        entry = f"{node.name} = {node.op} {node.target} {args!r} {kwargs!r} -> {_describe(node.meta.get('val'))}"
        if placements is not None:
            entry += f" {tuple(placements)}"
        entries.append(_ADDRESS.sub("", entry))
        sources.append(user_source_line(node) if node.op == "call_function" else "")
    return entries, sources


def collective_entries(gm: fx.GraphModule, mesh: DeviceMesh) -> tuple[list[str], list[str]]:
    """One line per collective of a local graph, in graph order (kind, mesh dim of its process group,
    reduce op, input dtype and shape, and the parameter it moves, if any), and its source line.

    Process groups are named by ``mesh``'s dim: their names differ between ranks of a 2-D mesh (rank
    0's data-parallel group is not rank 1's). Input shapes are compared on a 1-D mesh only: on an N-D
    mesh only the ranks of one group must agree on them, and ranks of different groups may hold pieces
    of other sizes (an uneven tensor-parallel shard, then sharded again by FSDP). Split sizes of an
    all-to-all are left out: they may differ by rank (uneven pieces)."""
    dims = {}
    for d in range(mesh.ndim):
        try:
            dims[mesh.get_group(d).group_name] = f"mesh dim {d}"
        except Exception:  # noqa: BLE001 - a mesh without a group for this dim (a single-rank dim)
            pass
    entries, sources = [], []
    for node in gm.graph.nodes:
        kind = COLLECTIVES.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        data = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        group = node.args[-1]  # every functional collective takes its group name last
        op = f" {node.args[1]}" if kind in ("all_reduce", "reduce_scatter") else ""
        value = "" if kind == "all_to_all" or data is None or mesh.ndim > 1 else _describe(data.meta.get("val"))
        fqn = node.meta.get("fqn")
        where = dims.get(group) or _group_size(group)
        entries.append(f"{kind}{op} on {where} {value}" + (f" ({fqn})" if fqn else ""))
        sources.append(user_source_line(node))
    return entries, sources


def _group_size(group: Any) -> str:
    """A process group outside the mesh's dims, by its size (its name may differ between ranks)."""
    try:
        return f"a group of {dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))} ranks"
    except Exception:  # noqa: BLE001 - an unresolvable name: say so, the same on every rank
        return "a group outside the mesh"


def state_entries(model: nn.Module, placements_of) -> tuple[list[str], list[str]]:
    """One line per parameter (name, global shape, dtype, whether on the meta device, requires_grad,
    ``placements_of(fqn, p)``) and per buffer of ``model``; values are never read."""
    entries = [
        f"parameter {fqn}: {_describe(p)}{_meta(p)} requires_grad={p.requires_grad} {tuple(placements_of(fqn, p))}"
        for fqn, p in model.named_parameters()
    ]
    entries += [f"buffer {fqn}: {_describe(b)}{_meta(b)}" for fqn, b in model.named_buffers()]
    return entries, [""] * len(entries)


def _meta(t: torch.Tensor) -> str:
    # A rank on the meta device skips the broadcast the others enter: a mismatch must be caught here.
    return " meta" if t.is_meta else ""


def _enabled(mesh: DeviceMesh) -> bool:
    return dist.is_initialized() and dist.get_backend() != "fake" and mesh.mesh.numel() > 1


# What a refusal suggests: a text, or a function of the index of the first differing entry giving one
# (None: the default, :data:`_USER_FIX`).
Fix = Union[None, str, Callable[[int], Optional[str]]]


def check_ranks_agree(
    what: str,
    entries: Sequence[str],
    sources: Sequence[str],
    mesh: DeviceMesh,
    wait_for: Optional[timedelta] = None,
    fix: Fix = None,
) -> None:
    """Raise on every rank of ``mesh`` unless all of them hold the same ``entries``.

    ``what`` names the thing compared ("the global graph of the step"); it is compared too, so it
    must not depend on the rank. ``wait_for`` bounds the wait for the other ranks (the step's
    ``timeout``); default :data:`timeout`, else the store's timeout. ``fix``: what the error suggests
    (default: look for rank-dependent code in the user's program), or a function of the index in
    ``entries`` of the first difference returning it (None: the default).

    Raises:
        DivergenceError: some ranks' entries differ from the mesh's first rank's (names them and the
            first differing entry with each side's source line), or a rank did not arrive in time
            (names the ranks that did not).
    """
    if not _enabled(mesh):
        return
    store = dist.distributed_c10d._get_default_store()
    wait = wait_for or (timedelta(seconds=timeout) if timeout is not None else store.timeout)
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    me, first = dist.get_rank(), ranks[0]
    # The mesh's ranks in the key too: disjoint meshes check their own programs side by side.
    group = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).hexdigest()
    prefix = f"spmd_expand/rank_check/{group}/{next(_serials)}/"
    # The check's own name first: ranks at different checks (one failed or compiled more before)
    # show that as their first difference.
    entries, sources = [f"check of {what}", *entries], ["", *sources]
    digest = hashlib.blake2b("\n".join(entries).encode(), digest_size=16).hexdigest()
    payload = json.dumps([entries, sources])

    def waited(keys: list[str], missing) -> None:
        try:
            store.wait(keys, wait)
        except Exception as e:  # noqa: BLE001 - the store's timeout type differs between stores
            raise DivergenceError(
                f"rank {me} waited {wait.total_seconds():.0f} s for {missing()} at the cross-rank check of "
                f"{what}: they did not reach it (they failed, hang elsewhere, or compile another program). "
                f"If their compilation is that slow, raise the timeout (spmd.compile(..., timeout=...), or spmd_expand.rank_check.timeout) ({e})"
            ) from None

    if me == first:
        store.set(prefix + f"entries/{me}", payload)
        store.set(prefix + "digest", digest)
    waited([prefix + "digest"], lambda: f"rank {first}")
    differs = store.get(prefix + "digest").decode() != digest
    if differs:
        store.set(prefix + f"entries/{me}", payload)
        store.append(prefix + "differ", f"{me} ")
    store.set(prefix + f"arrived/{me}", "1")
    if store.add(prefix + "arrived", 1) == len(ranks):
        store.set(prefix + "done", "1")
    waited(
        [prefix + "done"],
        lambda: "ranks " + ", ".join(str(r) for r in ranks if not store.check([prefix + f"arrived/{r}"])),
    )
    if not store.check([prefix + "differ"]):
        return
    differing = sorted(int(r) for r in store.get(prefix + "differ").decode().split())
    other = differing[0]
    theirs = {r: json.loads(store.get(prefix + f"entries/{r}")) for r in (first, other)}
    raise DivergenceError(_report(what, ranks, differing, first, other, theirs[first], theirs[other], fix))


_USER_FIX = (
    "every rank must build the same model and run the same step; look for code that depends on "
    "the rank (torch.distributed.get_rank(), a rank-dependent size or constant) near the lines above"
)


def _report(what: str, ranks, differing, first: int, other: int, a, b, fix: Fix = None) -> str:
    (entries_a, sources_a), (entries_b, sources_b) = a, b
    index = next((i for i, (x, y) in enumerate(zip(entries_a, entries_b)) if x != y), min(len(entries_a), len(entries_b)))
    if callable(fix):
        fix = fix(index - 1)  # the caller's entries follow the check's own name

    def side(entries, sources) -> str:
        if index >= len(entries):
            return "<nothing: ends here>"
        source = sources[index]
        return entries[index] + (f"\n      at {source}" if source else "")

    shown = ", ".join(str(r) for r in differing)
    return (
        f"the ranks do not run the same program: rank(s) {shown} differ from rank {first} in {what} "
        f"({len(differing)} of {len(ranks)} ranks of the mesh).\n"
        f"  first difference (line {index + 1}):\n"
        f"    rank {first}: {side(entries_a, sources_a)}\n"
        f"    rank {other}: {side(entries_b, sources_b)}\n"
        f"  fix: {fix or _USER_FIX}. "
        + (_AT_ANOTHER_CHECK if index == 0 else "")
        + "To see every difference, dump both ranks' graphs (spmd-expand dump) and spmd-expand diff them"
    )


# The first difference is the check's own name: the ranks are at different checks.
_AT_ANOTHER_CHECK = (
    "The first difference is the check itself: the ranks are at different points, because one of them failed "
    "earlier (see its own error) or compiled more graphs (under torch.compile: a rank whose Dynamo guards "
    "failed alone, e.g. on a batch of another shape there, compiles where the others run their graph). "
)
