"""Compile-time scale in the world size: ``spmd-expand dump`` of a train step at W = 8 ... 16,384.

For each plan (DDP, FSDP, TP on a 1-D mesh of W ranks; FSDP+TP on a 2-D mesh of sqrt(W) x sqrt(W)),
one fresh process per (plan, W) runs ``spmd-expand dump`` on torch's fake process group. DDP and FSDP
dump the GPT (``--layers 4``); TP and FSDP+TP dump the MLP, because the GPT's attention views its
heads out of a sharded projection, which DTensor refuses unless the heads divide the TP size (4 heads:
W <= 4). Each run is on torch's fake
process group (this process is rank 0; no communication), and this reports the per-rank graph's
nodes after expansion and after the passes, the collectives per step, the process's wall seconds and
its peak resident memory (``ru_maxrss``). The baseline is each plan's smallest W in the same run: the
ratios say how far compile time and graph size grow with W (GSPMD's anchor: not at all).

Prints one JSON object; the largest W that completed is given per plan.
Run: ``python bench/scale.py [--world-sizes 8 64 512 4096 16384] [--plans ddp fsdp tp fsdp+tp] [--layers 4]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


MODELS = {"ddp": "gpt", "fsdp": "gpt", "tp": "mlp", "fsdp+tp": "mlp"}


def run_dump(plan: str, world: int, layers: int, timeout_s: float) -> dict:
    side = math.isqrt(world)
    mesh = f"{side}x{side}" if plan == "fsdp+tp" else str(world)
    if plan == "fsdp+tp" and side * side != world:
        return {"skipped": f"W={world} is not a square"}
    with tempfile.TemporaryDirectory() as out:
        model = ["--model", "gpt", "--layers", str(layers)] if MODELS[plan] == "gpt" else ["--model", MODELS[plan]]
        command = [sys.executable, "-m", "spmd_expand.app.cli", "dump", *model, "--plan", plan, "--mesh", mesh,
                   "--out", out, "--no-picture"]
        log = Path(out) / "stderr.txt"
        start = time.perf_counter()
        with open(log, "w") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
            # os.wait4, not communicate(): the child's own peak memory comes with its exit status.
            while True:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    process.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.perf_counter() - start > timeout_s:
                    process.kill()
                    process.wait()
                    return {"mesh": mesh, "failed": f"timed out after {timeout_s:.0f} s"}
                time.sleep(0.05)
        seconds = time.perf_counter() - start
        if process.returncode != 0:
            return {"mesh": mesh, "failed": (log.read_text().strip().splitlines() or ["?"])[-1]}
        summary = json.loads((Path(out) / "summary.json").read_text())
    stages = summary["stages"]
    return {
        "mesh": mesh,
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
        "expanded_nodes": stages["expanded"]["nodes"],
        "nodes_after_passes": stages["passes"]["nodes"],
        "collectives_per_step": {k: v["count"] for k, v in summary["collectives_per_step"].items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 64, 512, 1024, 4096, 16384])
    parser.add_argument("--plans", nargs="+", default=["ddp", "fsdp", "tp", "fsdp+tp"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per dump before it counts as failed")
    args = parser.parse_args()
    table: dict = {}
    for plan in args.plans:
        rows = {}
        for world in args.world_sizes:
            rows[world] = run_dump(plan, world, args.layers, args.timeout)
            print(f"scale: {plan} W={world}: {rows[world]}", file=sys.stderr)
        done = [w for w, r in rows.items() if "seconds" in r]
        base = rows[done[0]] if done else None
        for w in done:
            rows[w]["seconds_vs_smallest"] = round(rows[w]["seconds"] / base["seconds"], 3)
            rows[w]["nodes_vs_smallest"] = round(rows[w]["nodes_after_passes"] / base["nodes_after_passes"], 3)
        table[plan] = {
            "model": f"gpt L={args.layers}" if MODELS[plan] == "gpt" else MODELS[plan],
            "largest_world_size_completed": max(done) if done else None,
            "by_world_size": rows,
        }
    print(json.dumps({"plans": table}, indent=2))


if __name__ == "__main__":
    main()
