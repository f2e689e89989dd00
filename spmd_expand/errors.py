"""The one exception family of spmd_expand.

Every error a user can hit while compiling a step is an :class:`SpmdError`. Errors about a graph node
name the op, the node, the user's source line (``node.meta["stack_trace"]``), the input placements,
and what to do about it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Sequence

import torch
import torch.fx as fx

__all__ = [
    "SpmdError",
    "TraceError",
    "UnsupportedOpError",
    "PlacementError",
    "PlanError",
    "BatchError",
    "PassError",
    "DivergenceError",
    "CollectiveError",
    "user_source_line",
    "first_line",
]


class SpmdError(RuntimeError):
    """Base class of every error raised by spmd_expand."""


class TraceError(SpmdError):
    """The train step could not be traced into one graph (data-dependent control flow, wrong arguments)."""


class PlanError(SpmdError):
    """The parallel plan does not fit the mesh, the model or the step's arguments."""


class BatchError(SpmdError):
    """The ranks' local batches do not form a global batch the plan can split: local batches of
    different shapes across ranks (uneven or empty), or a batch dim the batch tensors do not have.
    Raised on every rank of the mesh at once, before any collective of the step runs."""


class PassError(SpmdError):
    """A graph pass failed: its ``requires`` did not hold, it raised, or its ``ensures`` check failed
    afterwards; or ``passes=`` named a pass that does not exist. The message names the pass."""


class DivergenceError(SpmdError):
    """The ranks of a mesh do not run the same program (a model built differently, rank-dependent code
    in the step, optimizer hyperparameters that differ between ranks), or a rank did not reach a
    cross-rank check in time. Raised on every rank before the program's first collective
    (:mod:`spmd_expand.rank_check`; hyperparameters: :func:`spmd_expand.guards.check_batch`), instead
    of a hang or a wrong result."""


class CollectiveError(SpmdError):
    """A collective of the compiled step failed while it ran (timed out, or lost a peer that died).
    Names the collective this rank last issued (node, kind, bytes, group or mesh dim) and how many of
    the step's collectives it had issued (:mod:`spmd_expand.watch`); the original error is its
    ``__cause__``."""


class UnsupportedOpError(SpmdError):
    """An op has no sharding rule, neither in DTensor nor in spmd_expand."""


class PlacementError(SpmdError):
    """An op's inputs cannot be brought to a placement the op accepts."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type name when the message is empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@functools.lru_cache(maxsize=None)
def _own_directories() -> tuple[str, ...]:
    """torch's directory and spmd_expand's (``spmd_expand.passes`` and ``.tools`` live beside the
    package in a checkout), each ending in a separator."""
    found = [os.path.dirname(torch.__file__)]
    for name in ("spmd_expand", "spmd_expand.passes", "spmd_expand.tools"):
        spec = importlib.util.find_spec(name)
        found += list(spec.submodule_search_locations or ()) if spec is not None else []
    return tuple(os.path.join(os.path.realpath(d), "") for d in found)


@functools.lru_cache(maxsize=4096)
def in_torch_or_spmd_expand(filename: str) -> bool:
    """Whether ``filename`` is torch's or spmd_expand's own code: a file under their directories, not
    any path that contains their names (a user's project may be called ``spmd_expand``)."""
    return os.path.realpath(filename).startswith(_own_directories())


def user_source_line(node: fx.Node) -> str:
    """The innermost frame of ``node.meta["stack_trace"]`` that is not torch's own code.

    Returns ``"<unknown source>"`` when the node has no stack trace.
    """
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines()]
    # A stack trace alternates 'File "...", line N, in fn' and the source text of that line.
    located = []
    for i, line in enumerate(frames):
        if line.startswith("File "):
            code = frames[i + 1] if i + 1 < len(frames) and not frames[i + 1].startswith("File ") else ""
            located.append((line, code))
    user = [(loc, code) for loc, code in located if not in_torch_or_spmd_expand(loc.split('"')[1] if loc.count('"') >= 2 else loc)]
    pick = (user or located or [("<unknown source>", "")])[-1]
    return f"{pick[0]}: {pick[1]}" if pick[1] else pick[0]


def node_error(
    cls: type[SpmdError],
    node: fx.Node,
    problem: str,
    *,
    placements: Sequence[Any] = (),
    fix: str,
) -> SpmdError:
    """Build an error of type ``cls`` that names the op, the node, the source line, placements and fix."""
    target = getattr(node.target, "__name__", None) or str(node.target)
    shown = ", ".join(str(p) for p in placements) or "(none)"
    return cls(
        f"{problem}\n"
        f"  op:               {node.target if hasattr(node.target, '_schema') else target}\n"
        f"  node:             {node.name}\n"
        f"  source:           {user_source_line(node)}\n"
        f"  input placements: {shown}\n"
        f"  fix:              {fix}"
    )
