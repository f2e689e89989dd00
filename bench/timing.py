"""Step timing shared by the benchmarks that compare variants on local gloo ranks.

Each rank runs one step of every variant per round, in a fixed interleaved order after a barrier, so
every variant sees the same machine load; times are rank-local wall seconds per step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch.distributed as dist


def time_interleaved(
    runs: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 0
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``(seconds per step of each variant over the rounds, seconds of each variant's warm-up)``.

    ``warmup`` steps of each variant run first, one variant after the other (compilation happens
    there); then ``rounds`` rounds of one step of every variant each, a barrier before every step.
    """
    warmup_s = {}
    for name, run in runs.items():
        start = time.perf_counter()
        for _ in range(warmup):
            run()
        warmup_s[name] = time.perf_counter() - start
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return samples, warmup_s


def summary(samples: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)
    return {
        "median_ms": 1e3 * statistics.median(samples),
        "p10_ms": 1e3 * ordered[int(0.1 * (len(ordered) - 1))],
        "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
    }
