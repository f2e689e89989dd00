"""A/B step time of two pass pipelines, compiled in one process and interleaved: for 1%-level decisions.

``bench/step_time.py`` compares many variants over 20 rounds; on a 2-core machine its ratios move by
~10% from one run to the next. To decide whether a pass (or a pass option) pays, this compiles the
same ``spmd.compile`` step twice on 2 local gloo ranks (demo GPT, AdamW foreach, Inductor) with the
two pipelines ``--a`` and ``--b`` (``"default"``, ``"none"`` or pass names separated by commas), then
runs ``--rounds`` rounds of one step of each, alternating, after a barrier each. Prints one JSON
object: per rank the median, p10 and p90 milliseconds of each and the ratio of the medians b / a.
Repeat a run before trusting a difference: on a 2-core machine repeated runs of one A/B differ by up
to 10% (horizontal_fusion off vs on, FSDP: 0.95, 1.10, 0.98); both ranks agree within a run.

Example (was the horizontal fusion worth it on this machine?):
``python bench/pass_ab.py --plan ddp --a default --b regather_for_backward,bucketing,overlap``
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import GPTConfig, build_gpt, language_model_step
from spmd_expand.app.presets import preset, preset_mesh
from timing import summary, time_interleaved  # bench/timing.py

CONFIG = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=96)  # the demo GPT
BATCH = 16  # global
WORLD = 2


def _passes(spec: str):
    if spec in ("default", "none"):
        return "default" if spec == "default" else []
    return [name for name in spec.split(",") if name]


def worker(rank: int, world: int, plan_name: str, a: str, b: str, rounds: int) -> dict:
    torch.set_num_threads(1)
    base = build_gpt(GPTConfig(**CONFIG), seed=0)
    torch.manual_seed(1)
    local = BATCH // world
    x = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]))[rank * local : (rank + 1) * local]
    y = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]))[rank * local : (rank + 1) * local]
    mesh = preset_mesh(plan_name, (world,), "cpu")
    runs = {}
    for name, spec in (("a", a), ("b", b)):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        step = spmd.compile(mesh=mesh, plan=preset(plan_name).build(model), passes=_passes(spec))(language_model_step)
        for _ in range(3):  # the first call creates AdamW's state; the second compiles the steady state
            step(model, optimizer, x, y)
        runs[name] = lambda s=step, m=model, o=optimizer: s(m, o, x, y)
    samples, _ = time_interleaved(runs, rounds)
    result = {name: summary(values) for name, values in samples.items()}
    result["ratio_b_to_a"] = result["b"]["median_ms"] / result["a"]["median_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--a", default="default", help='"default", "none" or pass names separated by commas')
    parser.add_argument("--b", default="none")
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    per_rank = run_local(worker, WORLD, args.plan, args.a, args.b, args.rounds, timeout_s=1800)
    print(json.dumps({"plan": args.plan, "a": args.a, "b": args.b, "rounds": args.rounds, "world_size": WORLD,
                      "config": CONFIG, "ranks": per_rank}, indent=2))


if __name__ == "__main__":
    main()
