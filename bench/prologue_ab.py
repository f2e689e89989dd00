"""A/B step time of the prologue split (``spmd_expand/prologue.py``): the per-call rank check in flight under the forward.

Compiles the demo GPT's DDP step twice in one process on 2 local gloo ranks (AdamW foreach, Inductor):
``split`` as ``spmd.compile`` lowers it (prologue and rest, the loss denominator in the check) and
``unsplit`` with the split turned off for its compilation (the check before the graph, blocking).
Then ``--rounds`` rounds of one call of each, alternating which goes first. Unlike
``bench/timing.py``'s rounds there is no barrier before a call: what the split hides is the ranks'
skew (a rank that arrives first at the check waits for the other), and a barrier would remove it
(with one, both measured equal). Prints one JSON object: per rank the median, p10, p90 and mean
milliseconds of each, and the ratio of the medians split / unsplit.

Run: ``python bench/prologue_ab.py [--rounds 300]`` (~1 min; not in ``make bench``). On a 2-core
machine repeat it before trusting a difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import spmd_expand as spmd
import spmd_expand.pipeline as pipeline
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import GPTConfig, build_gpt, language_model_step
from spmd_expand.app.presets import preset, preset_mesh
from timing import summary  # bench/timing.py

CONFIG = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=96)  # the demo GPT
BATCH = 16  # global
WORLD = 2


def worker(rank: int, world: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    local = BATCH // world
    x = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]))[rank * local : (rank + 1) * local]
    y = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]))[rank * local : (rank + 1) * local]
    mesh = preset_mesh("ddp", (world,), "cpu")
    split_prologue = pipeline.split_prologue
    calls, runners = {}, {}
    for name in ("split", "unsplit"):
        # The baseline's compilation sees no prologue (the module global compile_step calls).
        pipeline.split_prologue = split_prologue if name == "split" else (lambda *args: None)
        model = build_gpt(GPTConfig(**CONFIG), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        step = spmd.compile(mesh=mesh, plan=preset("ddp").build(model))(language_model_step)
        for _ in range(3):  # the first call creates AdamW's state; the second compiles the steady state
            step(model, optimizer, x, y)
        calls[name] = lambda s=step, m=model, o=optimizer: s(m, o, x, y)
        runners[name] = type(step.last.runner).__name__
    pipeline.split_prologue = split_prologue
    if runners != {"split": "PrologueRunner", "unsplit": "_Watched"}:
        raise RuntimeError(f"expected a split and an unsplit step, got runners {runners}")
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in (("split", "unsplit") if r % 2 == 0 else ("unsplit", "split")):
            start = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - start)
    result = {name: {**summary(v), "mean_ms": 1e3 * statistics.mean(v), "runner": runners[name]} for name, v in samples.items()}
    result["ratio_split_to_unsplit"] = result["split"]["median_ms"] / result["unsplit"]["median_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    per_rank = run_local(worker, WORLD, args.rounds, timeout_s=1800)
    print(json.dumps({"rounds": args.rounds, "world_size": WORLD, "config": CONFIG, "ranks": per_rank}, indent=2))


if __name__ == "__main__":
    main()
