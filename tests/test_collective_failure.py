"""A collective that fails while the compiled step runs raises CollectiveError naming its node.

Real gloo ranks (W=2, tests/collective_failure_cases.py) with ``spmd.compile(..., timeout=3)``; the
wrapping itself is spmd_expand/watch.py.
"""

from __future__ import annotations

import collective_failure_cases as cases
import pytest
import torch
import torch.fx as fx

import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.watch import _Collective, _Watched, _WatchedGroup, watch_collectives


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_stalled_rank_names_the_collective_and_node(lower):
    rank0, rank1 = run_local(cases.stalled_rank, 2, lower, timeout_s=300)
    name, message = rank0["error"]
    assert name == "CollectiveError", message
    # The loss denominator travels in the per-call check (spmd_expand/prologue.py): the gradients'
    # all_reduce is the first collective after the forward, the one rank 0 waits on.
    assert "on mesh dim 'dp' (ranks [0, 1]) this rank had issued 1 of the step's" in message
    assert "the last issued is all_reduce node 'all_reduce_" in message
    assert "collective_failure_cases.py" in message and "loss.backward()" in message
    assert "Timed out waiting 3000ms" in message  # the step's timeout, not the process group's 300 s
    assert rank1["error"] == ("RuntimeError", "rank 1 stalled")


def test_stopped_rank_fails_the_batch_check_within_the_timeout():
    rank0, rank1 = run_local(cases.stopped_rank, 2, timeout_s=300)
    name, message = rank0["error"]
    assert name == "CollectiveError", message
    assert "the batch check before the step" in message and "ranks [0, 1]" in message
    assert "Timed out waiting 3000ms" in message  # the step's timeout, not the process group's 300 s
    assert rank1 == {"ok": "stopped"}


def test_a_rank_failing_in_its_forward_still_gives_its_verdict():
    rank0, rank1 = run_local(cases.failing_prologue, 2, timeout_s=300)
    for name, message in (rank0["error"], rank1["error"]):
        assert name == "DivergenceError", message
        assert "param_groups[0]['lr']: rank 0 0.1, rank 1 0.05" in message, message


def test_absent_rank_fails_the_cross_rank_check_within_the_timeout():
    rank0, rank1 = run_local(cases.absent_rank, 2, timeout_s=300)
    name, message = rank0["error"]
    assert name == "DivergenceError" and "waited 3 s for ranks 1 at the cross-rank check" in message, message
    assert "wait timeout after 3000ms" in message  # the store's own words: the step's timeout applied
    assert rank1 == {"ok": "absent"}


class _CountingGroup:
    """Stands in for a process group: counts the collectives a runner issues on it."""

    def __init__(self) -> None:
        self.issued = 0

    def _get_sequence_number_for_group(self) -> int:
        return self.issued


def _watched(group: _CountingGroup, issue: int, error: Exception):
    collectives = [_Collective(f"all_reduce_{i}", "all_reduce", 64, "") for i in range(3)]

    def runner(*inputs):
        group.issued += issue
        raise error

    return _Watched(runner, [_WatchedGroup(group, "mesh dim 'dp' (ranks [0, 1])", collectives)], rank=0)


def test_only_communication_failures_after_an_issued_collective_are_renamed():
    group = _CountingGroup()
    with pytest.raises(spmd.CollectiveError, match="had issued 2 of the step's 3 collectives; the last issued is all_reduce node 'all_reduce_1'") as info:
        _watched(group, 2, RuntimeError("[gloo/pair.cc:553] Connection closed by peer"))()
    assert "Connection closed by peer" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    # The step's own errors pass through unchanged, collectives issued or not.
    with pytest.raises(ValueError, match="a shape error"):
        _watched(group, 1, ValueError("a shape error"))()
    # A communication error with no collective of the step issued is not the step's.
    with pytest.raises(RuntimeError, match="gloo: Timed out") as info:
        _watched(group, 0, RuntimeError("gloo: Timed out"))()
    assert not isinstance(info.value, spmd.CollectiveError)


def test_fake_process_group_is_not_watched(fake_mesh):
    name = fake_mesh.get_group().group_name

    def f(x):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name))

    gm = fx.symbolic_trace(f)
    assert watch_collectives(gm, gm, fake_mesh) is gm  # no sequence numbers: nothing to read


def test_bad_timeout_is_refused(fake_mesh):
    for bad in (0, -1.0, "10"):
        with pytest.raises(spmd.SpmdError, match="timeout must be a positive number of seconds"):
            spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), timeout=bad)(lambda m, o, x: None)
