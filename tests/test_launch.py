"""Tests for spmd_expand.app.launch: real gloo process groups on 2 local CPU ranks.

The rank functions live at module level here: spawned ranks unpickle them by qualified name,
importing this module through the ``sys.path`` they inherit from the pytest process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from spmd_expand.app import launch
from spmd_expand.app.launch import RankFailedError, is_distributed_launch, run_local

WORLD = 2


def all_reduce_rank(rank: int, world_size: int, scale: float) -> tuple[int, torch.Tensor]:
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t)
    return dist.get_world_size(), t


def raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the test worker")
    dist.barrier()  # rank 0 waits for a peer that never comes; the parent must end it
    return rank


def exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def killed_mid_collective(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
    t = torch.ones(4)
    dist.all_reduce(t)  # rank 0 loses its peer inside the collective: "Connection reset by peer"
    return rank


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(600)


def rank_one_never_arrives(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)
    dist.barrier()  # rank 0 waits here for a peer that is elsewhere: a hang


def test_all_reduce_sums_on_every_rank() -> None:
    results = run_local(all_reduce_rank, WORLD, 2.0, timeout_s=60)
    expected = torch.full((3,), 2.0 * sum(range(1, WORLD + 1)))
    assert len(results) == WORLD
    for size, tensor in results:
        assert size == WORLD
        torch.testing.assert_close(tensor, expected)


def test_raising_rank_is_reported_before_the_timeout() -> None:
    # A RankFailedError (not the TimeoutError of timeout_s) shows the failure was noticed first.
    with pytest.raises(RankFailedError) as info:
        run_local(raise_on_rank_one, WORLD, timeout_s=60)
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom from the test worker" in message
    assert "raise_on_rank_one" in message  # the traceback itself, not just the exception text


def test_rank_exiting_without_report_is_detected() -> None:
    with pytest.raises(RankFailedError) as info:
        run_local(exit_on_rank_one, WORLD, timeout_s=60)
    assert info.value.rank == 1
    assert "exited with code 3" in str(info.value)


def test_killed_rank_is_named_not_the_peer_it_broke() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_local(killed_mid_collective, WORLD, timeout_s=120)
    assert info.value.rank == 1, str(info.value)
    assert "was killed by SIGKILL" in str(info.value)
    assert time.monotonic() - start < 60  # noticed, not the timeout


def test_timeout_kills_ranks_and_names_them() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 had not reported"):
        run_local(sleep_forever, WORLD, timeout_s=3)


def test_timeout_shows_where_each_rank_hangs() -> None:
    # Long enough for both ranks to start (spawn, import torch) and reach their hang.
    with pytest.raises(TimeoutError) as info:
        run_local(rank_one_never_arrives, WORLD, timeout_s=20)
    message = str(info.value)
    if not hasattr(signal, "SIGUSR1"):  # Windows: no signal to ask with, and the error says so
        assert "stacks are not available on this platform" in message, message
        return
    rank0, rank1 = message.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "in rank_one_never_arrives" in rank0 and "in barrier" in rank0, message
    assert "in rank_one_never_arrives" in rank1 and "in barrier" not in rank1, message


def test_lambda_and_local_functions_are_refused() -> None:
    def local(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises(TypeError, match="module-level"):
        run_local(lambda rank, world_size: rank, WORLD)
    with pytest.raises(TypeError, match="module-level"):
        run_local(local, WORLD)


def test_is_distributed_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_distributed_launch()
    monkeypatch.setenv("RANK", "0")
    assert is_distributed_launch()
