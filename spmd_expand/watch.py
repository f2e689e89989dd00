"""A collective of a compiled step that fails or times out is named: its node, kind, group and bytes.

A compiled step's collectives run inside generated code (Inductor's, or the fx graph's): when one
times out or loses its peer, the communication library raises an error that names neither the step's
node nor the group's mesh dim, e.g. gloo's ``Timed out waiting 1800000ms for recv operation`` or
``Connection closed by peer``. :func:`watch_collectives` wraps the lowered step so that such an error
becomes a :class:`~spmd_expand.errors.CollectiveError` naming the collective this rank last issued,
how many of the step's collectives on that group it had issued, and the usual causes.

Which collective: each process group counts the collectives issued on it (its *sequence number*,
``ProcessGroup._get_sequence_number_for_group``, the counter torch's NCCL flight recorder reports
too). Read before the step runs and again when it fails, the difference on a group is the number of
the step's collectives issued on that group, so the graph's collectives on that group, in graph order,
name the last one issued. With overlapped communication several may be in flight; the error names
the last issued one and the count. Groups whose backend keeps no sequence number (torch's fake
process group) are not watched.

Timeouts: every collective runs under its process group's timeout (``init_process_group(timeout=...)``,
30 minutes for gloo by default). ``spmd.compile(..., timeout=...)`` sets the timeout of the mesh's
groups (:func:`set_group_timeouts`, ``ProcessGroup.set_timeout``) so a stuck collective fails after
that long instead.

Cost per call: one ``_get_sequence_number_for_group`` per watched group (~1 us each).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from .errors import CollectiveError, SpmdError, first_line, user_source_line
from .graph_stats import COLLECTIVES, collective_bytes

__all__ = ["watch_collectives", "set_group_timeouts", "as_timedelta", "is_communication_failure"]

# Messages of communication failures (gloo, NCCL, the TCP store) that are not a DistError subclass.
_COMM_FAILURE = ("gloo", "nccl", "timed out", "connection closed", "connection reset", "broken pipe")


@dataclass(frozen=True)
class _Collective:
    node: str
    kind: str
    nbytes: int
    source: str


def as_timedelta(timeout: Union[None, float, int, timedelta], what: str) -> Optional[timedelta]:
    """``timeout`` (seconds or a ``timedelta``) as a ``timedelta``; None stays None. ``what`` names
    the argument in the error.

    Raises:
        SpmdError: not positive, or not a number of seconds or a ``timedelta``.
    """
    if timeout is None:
        return None
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise SpmdError(f"{what} must be a positive number of seconds or a datetime.timedelta, got {given!r}")
    return timeout


def set_group_timeouts(mesh: DeviceMesh, timeout: timedelta) -> None:
    """Set the timeout of every process group of ``mesh`` (each mesh dim's) to ``timeout``
    (``ProcessGroup.set_timeout``: later collectives on the group, the step's and any other, fail
    after that long). No-op on torch's fake process group."""
    if dist.get_backend() == "fake":
        return
    for dim in range(mesh.ndim):
        mesh.get_group(dim).set_timeout(timeout)


def _group_name(node: fx.Node) -> Optional[str]:
    schema = node.target._schema
    for index, argument in enumerate(schema.arguments):
        if argument.name == "group_name":
            return node.args[index] if index < len(node.args) else node.kwargs.get("group_name")
    return None


def _sequence_number(group: dist.ProcessGroup) -> Optional[int]:
    try:
        return group._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001 - a backend without sequence numbers (fake): not watched
        return None


def _describe_group(group: dist.ProcessGroup, name: str, mesh: Optional[DeviceMesh]) -> str:
    if mesh is not None:
        for dim in range(mesh.ndim):
            if mesh.get_group(dim).group_name == name:
                dim_name = (mesh.mesh_dim_names or {})[dim] if mesh.mesh_dim_names else dim
                return f"mesh dim {dim_name!r} (ranks {dist.get_process_group_ranks(group)})"
    return f"process group {name!r} (ranks {dist.get_process_group_ranks(group)})"


@dataclass
class _WatchedGroup:
    group: Any  # dist.ProcessGroup: anything with ``_get_sequence_number_for_group``
    description: str  # "mesh dim 'dp' (ranks [0, 1])"
    collectives: list[_Collective]  # the graph's collectives on this group, in graph order


class _Watched:
    """The lowered step, with its collectives named when one fails."""

    def __init__(self, runner: Callable[..., Any], groups: Sequence[_WatchedGroup], rank: int) -> None:
        self.runner = runner
        self.groups = list(groups)
        self.rank = rank

    def __call__(self, *inputs: Any) -> Any:
        before = [_sequence_number(g.group) for g in self.groups]
        try:
            return self.runner(*inputs)
        except Exception as e:
            issued = [(g, _sequence_number(g.group) - start) for g, start in zip(self.groups, before)]
            issued = [(g, count) for g, count in issued if count > 0]
            if not issued or not is_communication_failure(e):
                raise
            raise CollectiveError(self._message(e, issued)) from e

    def _message(self, error: Exception, issued: list) -> str:
        parts = []
        for watched, count in issued:
            collectives = watched.collectives
            last = collectives[min(count, len(collectives)) - 1]
            where = f" (from {last.source})" if last.source and last.source != "<unknown source>" else ""
            parts.append(
                f"on {watched.description} this rank had issued {count} of the step's {len(collectives)} "
                f"collectives; the last issued is {last.kind} node {last.node!r} ({last.nbytes:,} bytes from "
                f"this rank){where}"
            )
        return (
            f"rank {self.rank}: a collective of the compiled step failed: {'; '.join(parts)}. "
            f"The communication library said: {first_line(error)}. Usual causes: another rank failed or stopped calling "
            f"the step (look for its error first); ranks ran different code outside the compiled step; or the "
            f"collective takes longer than the process group's timeout (set it with spmd.compile(..., timeout=...) "
            f"or init_process_group(timeout=...)). The step stopped part way: parameters and optimizer states may "
            f"be partly updated; restore them from a checkpoint before going on"
        )


def is_communication_failure(error: Exception) -> bool:
    """Whether ``error`` comes from the communication library (a ``DistError``, or gloo's/NCCL's
    ``RuntimeError`` about a timeout or a lost connection)."""
    if isinstance(error, dist.DistError):
        return True
    message = str(error).lower()
    return any(word in message for word in _COMM_FAILURE)


def watch_collectives(gm: fx.GraphModule, runner: Callable[..., Any], mesh: Optional[DeviceMesh] = None) -> Callable[..., Any]:
    """``runner`` (the lowered ``gm``), raising :class:`~spmd_expand.errors.CollectiveError` when one
    of ``gm``'s collectives fails (timeout, lost peer); ``runner`` itself when ``gm`` has no collective
    on a group that keeps sequence numbers.

    ``mesh`` (optional) names the groups by mesh dim in the error. Errors that are not communication
    failures pass through unchanged.
    """
    groups: dict[str, _WatchedGroup] = {}
    unwatched: set[str] = set()
    for node in gm.graph.nodes:
        kind = COLLECTIVES.get(node.target) if node.op == "call_function" else None
        name = _group_name(node) if kind else None
        if name is None or name in unwatched:
            continue
        if name not in groups:
            group = dist.distributed_c10d._resolve_process_group(name)
            if _sequence_number(group) is None:
                unwatched.add(name)
                continue
            groups[name] = _WatchedGroup(group, _describe_group(group, name, mesh), [])
        groups[name].collectives.append(_Collective(node.name, kind, collective_bytes(node, kind), user_source_line(node)))
    return _Watched(runner, groups.values(), dist.get_rank()) if groups else runner
