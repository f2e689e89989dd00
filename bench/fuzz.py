"""Fuzzed parity at scale: thousands of seeded random models (tests/fuzz_cases.py) under DDP, FSDP and
TP on W local gloo ranks, each compared with the single-device run over the global batch.

Prints one JSON object: the cases run, the failures (seed, plan, case, why: make each a regression
in tests/test_fuzz.py), and time per case: the compiled steps (compilation included) and, as the
baseline measured in the same run, the single-device steps.
Run: ``python bench/fuzz.py [--seeds 1000] [--start 0] [--world-size 2] [--plans ddp fsdp tp]``; 2-D plans
on a 2 x W/2 mesh: ``--world-size 4 --plans fsdp+tp ddp+tp hsdp``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fuzz_cases  # noqa: E402

from spmd_expand.app.launch import run_local  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000, help="number of seeds (default 1000)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--plans", nargs="+", default=list(fuzz_cases.PLANS), choices=fuzz_cases.PLANS + fuzz_cases.PLANS_2D,
        help="default: the 1-D plans; the 2-D ones (fsdp+tp, ddp+tp, hsdp) need an even --world-size >= 4",
    )
    parser.add_argument("--chunk", type=int, default=50, help="seeds per launch of the ranks (default 50)")
    args = parser.parse_args()
    seeds = list(range(args.start, args.start + args.seeds))
    start = time.perf_counter()
    results: dict = {}
    for i in range(0, len(seeds), args.chunk):
        chunk = seeds[i : i + args.chunk]
        per_rank = run_local(fuzz_cases.run_fuzz, args.world_size, chunk, tuple(args.plans), timeout_s=3600)
        for rank, rank_results in enumerate(per_rank):
            for key, result in rank_results.items():
                results.setdefault(key, []).append(result)
        done = min(i + args.chunk, len(seeds))
        print(f"fuzz: {done}/{len(seeds)} seeds, {sum(not all(r['ok'] for r in v) for v in results.values())} failing", file=sys.stderr)
    failures = [
        {"seed": seed, "plan": plan, "rank": rank, "case": r["case"], "why": r["why"][-2000:]}
        for (seed, plan), per_rank in sorted(results.items())
        for rank, r in enumerate(per_rank)
        if not r["ok"]
    ]
    rank0 = [per_rank[0] for per_rank in results.values() if "widening" in per_rank[0]]
    print(
        json.dumps(
            {
                "world_size": args.world_size,
                "seeds": [seeds[0], seeds[-1]],
                "plans": args.plans,
                "cases": len(results),
                "failing_cases": len({(f["seed"], f["plan"]) for f in failures}),
                "failures": failures,
                # Each case's largest roundoff sensitivity as a multiple of the fixed tolerance
                # (fuzz_cases.compare_parameters): how much the comparison was widened, at its widest element.
                "widening_median": statistics.median(r["widening"] for r in rank0) if rank0 else None,
                "widening_max": max(r["widening"] for r in rank0) if rank0 else None,
                "median_compiled_s_per_case": statistics.median(r["compiled_s"] for r in rank0) if rank0 else None,
                "median_single_device_s_per_case": statistics.median(r["reference_s"] for r in rank0) if rank0 else None,
                "wall_s": time.perf_counter() - start,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
