"""Time to the first fast step: compilation included, cold and warm Inductor caches, on 2 gloo ranks.

For the demo GPT (``bench/step_time.py``'s ``demo`` config, AdamW foreach, 2 local CPU ranks), each
variant runs in a fresh process twice with the same new Inductor cache folder
(``TORCHINDUCTOR_CACHE_DIR``): first cold (empty folder), then warm (what the first run left). Rank 0
reports the seconds of its first step (trace, expansion and Inductor for ``spmd.compile``; Dynamo,
AOTAutograd and Inductor for ``torch.compile``), of its second step, and Inductor's cache counters
(``fxgraph_cache_hit`` / ``_miss`` / ``_bypass``). Variants:

* ``spmd_ddp`` / ``spmd_fsdp``: ``spmd.compile`` with the DDP / FSDP preset (default passes);
* ``spmd_ddp_sgd``: ``spmd_ddp`` with plain SGD (``foreach=True``, no momentum) for AdamW: how much of
  the first step is compiling the optimizer's update, which ``spmd.compile`` puts in the step's graph;
* ``torch_compile_ddp``: ``torch.compile(DistributedDataParallel(model))``, the optimizer eager: the
  baseline of issue 11 (spmd's first step should come no later than this one's);
* ``torch_compile_ddp_optimizer``: the same with ``optimizer.step`` compiled too
  (``torch.compile(optimizer.step)``, torch's compiled-optimizer recipe): as much compiled as
  ``spmd.compile`` compiles.

Prints one JSON object. Run: ``python bench/first_step.py [--variants spmd_ddp ... torch_compile_ddp_optimizer]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("spmd_ddp", "spmd_fsdp", "spmd_ddp_sgd", "torch_compile_ddp", "torch_compile_ddp_optimizer")
CONFIG = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=96, batch=16)
WORLD = 2


def worker(rank: int, world: int, variant: str) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    import spmd_expand as spmd
    from spmd_expand.app.models import GPTConfig, build_gpt, language_model_step
    from spmd_expand.app.presets import preset, preset_mesh

    gpt = GPTConfig(**{k: CONFIG[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")})
    model = build_gpt(gpt, seed=0)
    torch.manual_seed(1)
    local = CONFIG["batch"] // world
    x = torch.randint(0, CONFIG["vocab_size"], (local, CONFIG["block_size"]))
    y = torch.randint(0, CONFIG["vocab_size"], (local, CONFIG["block_size"]))
    if variant.startswith("spmd_"):
        plan_name = variant.removeprefix("spmd_").removesuffix("_sgd")
        if variant.endswith("_sgd"):
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        mesh = preset_mesh(plan_name, (world,), "cpu")
        step = spmd.compile(mesh=mesh, plan=preset(plan_name).build(model))(language_model_step)
        run = lambda: step(model, optimizer, x, y)  # noqa: E731
    else:
        compiled = torch.compile(DistributedDataParallel(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        optimizer_step = torch.compile(optimizer.step) if variant.endswith("_optimizer") else optimizer.step

        def run():
            loss = compiled(x, y)
            loss.backward()
            optimizer_step()
            optimizer.zero_grad()
            return loss

    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    inductor = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {"first_step_s": seconds[0], "later_step_s": min(seconds[1:]), "inductor_cache": inductor}


def _child(variant: str) -> None:
    from spmd_expand.app.launch import run_local

    print(json.dumps(run_local(worker, WORLD, variant, timeout_s=1200)[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    results: dict = {}
    for variant in args.variants:
        with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            for run in ("cold", "warm"):
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, __file__, "--child", variant], env=env, capture_output=True, text=True, timeout=1800
                )
                if done.returncode != 0:
                    results.setdefault(variant, {})[run] = {"failed": done.stderr.strip().splitlines()[-1:]}
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["process_s"] = time.perf_counter() - start
                results.setdefault(variant, {})[run] = row
                print(f"first_step: {variant} {run}: {row}", file=sys.stderr)
    for baseline_name in ("torch_compile_ddp", "torch_compile_ddp_optimizer"):
        baseline = results.get(baseline_name, {})
        for variant, runs in results.items():
            for run, row in runs.items():
                base = baseline.get(run, {}).get("first_step_s")
                if base and "first_step_s" in row:
                    row[f"first_step_vs_{baseline_name}"] = round(row["first_step_s"] / base, 2)
    print(json.dumps({"config": CONFIG, "world_size": WORLD, "variants": results}, indent=2))


if __name__ == "__main__":
    main()
