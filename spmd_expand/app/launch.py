"""Run a function on several local ranks, or join a ``torchrun`` launch.

:func:`run_local` is how the library (the ``spmd-expand train`` command, the test suite) runs a
function on ``W`` local CPU ranks joined by a real ``gloo`` process group, without ``torchrun``.
:func:`is_distributed_launch` and :func:`init_from_env` cover the other case, where ``torchrun``
started this process and its environment says which rank it is.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailedError", "init_from_env", "is_distributed_launch", "run_local"]

THREADS_ENV = "SPMD_THREADS_PER_RANK"
"""Environment variable read by each rank of :func:`run_local`: its intra-op thread count (default 1)."""

START_METHOD_ENV = "SPMD_START_METHOD"
"""Environment variable read by :func:`run_local` when its ``start_method`` is None: "spawn" (the
default) or "forkserver"."""

_START_METHODS = ("spawn", "forkserver")
# Modules the fork server imports once, so that its ranks start with them imported.
_FORKSERVER_PRELOAD = ["spmd_expand"]
# Environment variables that torch, its OpenMP and MKL runtimes and Inductor's config read when they
# are imported or loaded: a rank forked from the server holds the values the server started with.
_IMPORT_TIME_ENV_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_")
_forkserver_env: dict[str, str] | None = None  # those variables when this process's fork server started

# Message kinds a rank puts on the result queue, as ``(rank, kind, payload)``.
_OK = "ok"  # payload: the pickled return value (bytes)
_ERROR = "error"  # payload: the formatted traceback (str)

_DEATH_GRACE_S = 1.0  # how long a rank's error waits for a peer's death by a signal to show (see _root_cause)
_POLL_S = 0.1  # how long one wait on the result queue lasts before the ranks' exit codes are checked
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # asks a rank for its Python stacks (faulthandler); not on Windows
_STACK_GRACE_S = 3.0  # how long a timed-out run waits for its ranks' stacks
_TEARDOWN_GRACE_S = 30.0  # how long ranks that all reported may take to leave before being killed
_KILL_GRACE_S = 5.0  # how long a terminated rank may take before it is killed outright


class RankFailedError(RuntimeError):
    """A rank of :func:`run_local` raised, or exited without reporting a result.

    Attributes:
        rank: the failing rank.
        details: the rank's formatted traceback, or a description of how it exited.
    """

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local processes.

    Each rank is a new process of the ``torch.multiprocessing`` context ``start_method``, running
    in this process's working directory with its ``sys.path`` and environment as they are at the
    call. It limits itself to ``$SPMD_THREADS_PER_RANK`` intra-op threads (default 1), joins a
    process group of ``backend`` (on Linux gloo is pointed at the ``lo`` interface unless
    ``GLOO_SOCKET_IFNAME`` is already set), calls ``fn``, reports the result, waits at a barrier,
    destroys the group and leaves with ``os._exit``, skipping the interpreter shutdown in which gloo
    is known to abort.

    The rendezvous is a ``TCPStore`` served by this process on 127.0.0.1, listening on a port the
    system picks before any rank starts. (A port picked free and handed to rank 0 to listen on could
    be taken meanwhile, which needed a retry loop, and a rank retrying its connection to a port
    nobody listens on yet can end up connected to itself, which TCP allows.)

    A run that times out shows where each unfinished rank was: the Python stacks of its threads, which
    the rank writes (:mod:`faulthandler`) when asked with ``SIGUSR1`` (not on Windows).

    ``start_method`` (default: ``$SPMD_START_METHOD``, else "spawn") is how ranks start:

    - "spawn": a fresh interpreter per rank, which imports torch and ``fn``'s module (about 3 s
      per run on 2 CPU cores, measured with both ranks importing ``spmd_expand``).
    - "forkserver" (not on Windows, which falls back to "spawn"): ranks are forked from one server
      process per calling process, started at the first such run with ``spmd_expand`` (and torch)
      imported, so a run starts in milliseconds (Python's :mod:`multiprocessing.forkserver`; the test
      suite uses it). The ranks run the code of those modules as the server imported it.
      Variables that torch, OpenMP, MKL and Inductor's config read at import (names starting with
      ``TORCH``, ``PYTORCH``, ``OMP_``, ``MKL_``, ``KMP_``) hold the server's values in a forked
      rank, so a run whose values of them differ from those the server started with is spawned
      instead.

    Either way ``fn`` must be importable by its qualified name: a module-level function (or a
    picklable callable such as a ``functools.partial`` of one), in a module the ranks can import
    with the caller's ``sys.path``. ``args`` and ``kwargs`` must be picklable, and a script that
    calls ``run_local`` must guard its entry point with ``if __name__ == "__main__":``.

    Return values are sent back with plain :mod:`pickle`, so they must be picklable; return
    tensors as CPU tensors (they are copied by value, not shared).

    Args:
        fn: the per-rank function, called as ``fn(rank, world_size, *args, **kwargs)``.
        world_size: the number of ranks, at least 1.
        *args: further positional arguments for ``fn``.
        backend: the ``torch.distributed`` backend of the process group.
        timeout_s: the most the whole run may take, rendezvous included; also the process
            group's collective timeout.
        start_method: "spawn" or "forkserver", or None for ``$SPMD_START_METHOD`` (default
            "spawn"); see above.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The ranks' return values, ordered by rank.

    Raises:
        TypeError: ``fn`` is a lambda or a local function, which cannot be pickled by name.
        ValueError: ``world_size`` is below 1, ``timeout_s`` is not positive, or the start method
            is not "spawn" or "forkserver".
        RankFailedError: a rank raised (the message holds its traceback), or a rank exited without
            reporting (the message holds its exit code or signal). The other ranks are terminated
            first.
        TimeoutError: not every rank reported within ``timeout_s``; the message names the ranks
            that had not and shows their Python stacks, and all ranks are killed first.
    """
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"run_local needs a module-level function, got {qualname!r}: its ranks are new "
            "processes, which receive the function pickled by its qualified name"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ctx = _context(start_method)
    deadline = time.monotonic() + timeout_s
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    result_queue = ctx.Queue()
    # multiprocessing gives every rank this process's sys.path and working directory; the environment a
    # forked rank starts with is the server's, so it is sent too.
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="spmd-ranks-") as stacks:
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, backend, store.port, timeout_s, fn, args, kwargs, env, result_queue, stacks),
                name=f"spmd-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            results = _collect(procs, result_queue, deadline, timeout_s, stacks)
        except BaseException:
            _stop(procs)
            raise
        _join_or_stop(procs, min(_TEARDOWN_GRACE_S, max(deadline - time.monotonic(), 0.0)))
    del store  # the ranks have left: stop serving the rendezvous
    return results


def _context(start_method: str | None) -> Any:
    """The ``torch.multiprocessing`` context for ``start_method`` (see :func:`run_local`).

    Raises:
        ValueError: the method is not "spawn" or "forkserver".
    """
    global _forkserver_env
    method = start_method or os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in _START_METHODS:
        source = "start_method" if start_method else f"${START_METHOD_ENV}"
        raise ValueError(f"{source} must be one of {', '.join(_START_METHODS)}, got {method!r}")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        env = {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_ENV_PREFIXES)}
        if _forkserver_env is None:
            _forkserver_env = env  # the server starts at this run's first Process.start()
        if env == _forkserver_env:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
            return ctx
    return mp.get_context("spawn")


def is_distributed_launch() -> bool:
    """Tell whether this process was started by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialize the default process group from ``torchrun``'s environment.

    With ``backend=None`` the backend is NCCL when CUDA is available and gloo otherwise; with NCCL
    the current CUDA device is set to ``$LOCAL_RANK``. If the default group already exists, it is
    kept and its rank and size are returned.

    Args:
        backend: the ``torch.distributed`` backend, or None to choose as above.

    Returns:
        ``(rank, world_size)`` of this process.

    Raises:
        RuntimeError: ``RANK`` or ``WORLD_SIZE`` is not set (not started by ``torchrun``).
        ValueError: the rendezvous variables (``MASTER_ADDR``, ``MASTER_PORT``) are missing, as
            raised by ``torch.distributed``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not is_distributed_launch():
        raise RuntimeError("init_from_env needs RANK and WORLD_SIZE in the environment (use torchrun)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def _collect(
    procs: list[Any], result_queue: Any, deadline: float, timeout_s: float, stacks: str
) -> list[Any]:
    """Wait for every rank's report and return the unpickled results, ordered by rank.

    Raises:
        RankFailedError: a rank reported an error or exited without reporting.
        TimeoutError: ``deadline`` passed first (with the unfinished ranks' stacks, see :func:`_stacks`).
    """
    results: list[Any] = [None] * len(procs)
    pending = set(range(len(procs)))
    seen_dead: set[int] = set()
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"run_local timed out after {timeout_s:g} s; ranks {sorted(pending)} of "
                f"{len(procs)} had not reported. Where they were:\n{_stacks(procs, sorted(pending), stacks)}"
            )
        try:
            rank, kind, payload = result_queue.get(timeout=min(_POLL_S, remaining))
        except queue_mod.Empty:
            # A rank writes its report to the pipe before it exits, so a rank seen dead on two
            # consecutive empty polls has really left without reporting.
            dead = {rank for rank in pending if procs[rank].exitcode is not None}
            gone = sorted(dead & seen_dead)
            if gone:
                raise RankFailedError(gone[0], _describe_exit(procs[gone[0]].exitcode))
            seen_dead = dead
            continue
        if kind == _OK:
            results[rank] = pickle.loads(payload)
            pending.discard(rank)
        else:
            raise _root_cause(procs, rank, payload)
    return results


def _stack_path(stacks: str, rank: int) -> str:
    return os.path.join(stacks, f"rank{rank}.txt")


def _stacks(procs: list[Any], ranks: list[int], stacks: str) -> str:
    """The Python stacks of ``ranks``, asked for with ``SIGUSR1`` (each rank registered a
    :mod:`faulthandler` dump to its file in ``stacks``); waits up to ``_STACK_GRACE_S``."""
    if _STACK_SIGNAL is None:
        return "(stacks are not available on this platform)"
    # Only ranks whose handler is in place (their file exists): before that the signal would kill them.
    asked = [
        r for r in ranks
        if procs[r].pid is not None and procs[r].exitcode is None and os.path.exists(_stack_path(stacks, r))
    ]
    for rank in asked:
        os.kill(procs[rank].pid, _STACK_SIGNAL)
    end = time.monotonic() + _STACK_GRACE_S
    last: dict[int, str] = {}
    texts: dict[int, str] = {}  # complete dumps: the signal handler writes at once, so two equal reads
    while len(texts) < len(asked) and time.monotonic() < end:
        time.sleep(0.1)
        for rank in set(asked) - set(texts):
            with open(_stack_path(stacks, rank)) as f:
                text = f.read()
            if text and last.get(rank) == text:
                texts[rank] = text
            last[rank] = text
    parts = []
    for rank in ranks:
        if rank in texts:
            parts.append(f"--- rank {rank} ---\n{texts[rank].rstrip()}")
        elif procs[rank].exitcode is not None:
            parts.append(f"--- rank {rank} --- ({_describe_exit(procs[rank].exitcode)})")
        else:
            parts.append(f"--- rank {rank} --- (no stack: it had not started running, or did not answer)")
    return "\n".join(parts)


def _root_cause(procs: list[Any], rank: int, payload: str) -> RankFailedError:
    """The error of ``rank``, or of the peer whose death caused it.

    A rank killed by a signal (SIGKILL from the OOM killer or a user, a crash) cannot report; its
    peers then fail inside their next collective ("Connection reset by peer") and report first.
    Such a dead peer is named instead, with the reporting rank's error after it.
    """
    end = time.monotonic() + _DEATH_GRACE_S
    while True:
        killed = [r for r, proc in enumerate(procs) if r != rank and proc.exitcode is not None and proc.exitcode < 0]
        if killed or time.monotonic() >= end:
            break
        time.sleep(0.05)
    if not killed:
        return RankFailedError(rank, payload)
    # SIGKILL first: a rank that aborts (SIGABRT) in the communication library is usually its victim.
    dead = min(killed, key=lambda r: (procs[r].exitcode != -signal.SIGKILL, r))
    last_line = payload.strip().splitlines()[-1] if payload.strip() else ""
    return RankFailedError(dead, f"{_describe_exit(procs[dead].exitcode)}; then rank {rank} failed: {last_line}")


def _describe_exit(exitcode: int) -> str:
    """Say how a rank that never reported ended, from its ``exitcode``."""
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return f"the process {how} without reporting a result (see its stderr)"


def _stop(procs: list[Any]) -> None:
    """Terminate the started ranks that are still running, then kill those that linger."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            proc.terminate()
    _join_or_stop(procs, _KILL_GRACE_S)


def _join_or_stop(procs: list[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` in all for the started ranks to exit, then kill those still running."""
    end = time.monotonic() + grace_s
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(end - time.monotonic(), 0.0))
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
            proc.join()


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    result_queue: Any,
    stacks: str,
) -> None:
    """Body of one rank: take the caller's environment ``env``, set up, run ``fn``, report, tear
    down, and leave with ``os._exit``."""
    try:
        os.environ.clear()
        os.environ.update(env)
        if _STACK_SIGNAL is not None:
            stack_file = open(_stack_path(stacks, rank) + ".part", "w")  # noqa: SIM115 - open until os._exit
            faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True)
            os.replace(stack_file.name, _stack_path(stacks, rank))  # exists once the handler is in place
        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception:
        _report(result_queue, rank, _ERROR, traceback.format_exc())
        _exit(1)
    try:
        payload = pickle.dumps(fn(rank, world_size, *args, **kwargs), pickle.HIGHEST_PROTOCOL)
    except BaseException:
        _report(result_queue, rank, _ERROR, traceback.format_exc())
        _exit(1)
    _report(result_queue, rank, _OK, payload)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        # The result is already reported; the parent ignores how a reported rank exits.
        traceback.print_exc()
        _exit(1)
    _exit(0)


def _report(result_queue: Any, rank: int, kind: str, payload: bytes | str) -> None:
    """Put a report on the queue and wait until it is written to the pipe."""
    result_queue.put((rank, kind, payload))
    result_queue.close()
    result_queue.join_thread()


def _exit(code: int) -> NoReturn:
    """Flush the standard streams and end the process without interpreter shutdown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
