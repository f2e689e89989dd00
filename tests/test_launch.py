"""Tests for spmd_expand.app.launch: real gloo process groups on 2 local CPU ranks.

The rank functions live at module level here: ranks unpickle them by qualified name, importing
this module through the ``sys.path`` they take from the pytest process. The suite starts ranks from a
fork server (conftest.py); the tests that name a start method run under both.
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
START_METHODS = ["spawn", "forkserver"]


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


def where_the_rank_runs(rank: int, world_size: int) -> tuple:
    import launch_probe  # a module only the caller's current sys.path finds

    return os.getcwd(), os.environ.get("SPMD_TEST_PROBE"), launch_probe.VALUE


def inductor_graph_cache(rank: int, world_size: int) -> bool:
    import torch._inductor.config as inductor_config

    return inductor_config.fx_graph_cache


@pytest.mark.parametrize("method", START_METHODS)
def test_all_reduce_sums_on_every_rank(method: str) -> None:
    results = run_local(all_reduce_rank, WORLD, 2.0, timeout_s=60, start_method=method)
    expected = torch.full((3,), 2.0 * sum(range(1, WORLD + 1)))
    assert len(results) == WORLD
    for size, tensor in results:
        assert size == WORLD
        torch.testing.assert_close(tensor, expected)


@pytest.mark.parametrize("method", START_METHODS)
def test_raising_rank_is_reported_before_the_timeout(method: str) -> None:
    # A RankFailedError (not the TimeoutError of timeout_s) shows the failure was noticed first.
    with pytest.raises(RankFailedError) as info:
        run_local(raise_on_rank_one, WORLD, timeout_s=60, start_method=method)
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


@pytest.mark.parametrize("method", START_METHODS)
def test_killed_rank_is_named_not_the_peer_it_broke(method: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_local(killed_mid_collective, WORLD, timeout_s=120, start_method=method)
    assert info.value.rank == 1, str(info.value)
    assert "was killed by SIGKILL" in str(info.value)
    assert time.monotonic() - start < 60  # noticed, not the timeout


@pytest.mark.parametrize("method", START_METHODS)
def test_ranks_take_the_callers_directory_path_and_environment(method, tmp_path, monkeypatch) -> None:
    """A rank runs where the caller is at the call: a fork server started before the caller changed
    directory, sys.path and environment still gives its ranks the new ones."""
    run_local(all_reduce_rank, WORLD, 1.0, timeout_s=60, start_method=method)  # the server, if any, is up
    (tmp_path / "launch_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPMD_TEST_PROBE", "set after the server started")
    results = run_local(where_the_rank_runs, WORLD, timeout_s=60, start_method=method)
    assert results == [(str(tmp_path), "set after the server started", 7)] * WORLD


def test_a_changed_import_time_variable_is_not_served_stale(monkeypatch) -> None:
    """Inductor reads TORCHINDUCTOR_FX_GRAPH_CACHE when it is imported, which a fork server did once:
    a run with another value than the server's is spawned, and its ranks see the new value. (Where
    there is no fork server, Windows, every run is spawned.)"""
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    run_local(all_reduce_rank, WORLD, 1.0, timeout_s=60, start_method="forkserver")
    served = "forkserver" if "forkserver" in torch.multiprocessing.get_all_start_methods() else "spawn"
    assert launch._context("forkserver").get_start_method() == served
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    assert launch._context("forkserver").get_start_method() == "spawn"
    assert run_local(inductor_graph_cache, WORLD, timeout_s=60, start_method="forkserver") == [False] * WORLD


def test_an_unknown_start_method_is_named(monkeypatch) -> None:
    with pytest.raises(ValueError, match="start_method must be one of spawn, forkserver, got 'fork'"):
        run_local(all_reduce_rank, WORLD, 1.0, start_method="fork")
    monkeypatch.setenv(launch.START_METHOD_ENV, "threads")
    with pytest.raises(ValueError, match=r"\$SPMD_START_METHOD must be one of spawn, forkserver, got 'threads'"):
        run_local(all_reduce_rank, WORLD, 1.0)


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
