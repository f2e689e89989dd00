"""Step time of the compiled train step against torch's eager data-parallel tools, on 2 gloo ranks.

Every variant trains the same GPT (``spmd_expand.app.models``, same seed) with AdamW (foreach) on the
same global batch split over 2 local CPU ranks (one intra-op thread each):

* ``spmd_ddp`` / ``spmd_fsdp``: ``spmd.compile`` with the DDP / FSDP preset, Inductor, default passes;
* ``spmd_ddp_nopasses`` / ``spmd_fsdp_nopasses``: the same with ``passes=[]``;
* ``torch_ddp``: ``DistributedDataParallel`` eager (default buckets);
* ``torch_fsdp2``: ``fully_shard`` on each block and the root, eager;
* ``spmd_backend_ddp`` / ``spmd_backend_fsdp``: ``spmd.parallelize`` then ``torch.compile(model,
  backend="spmd")`` (Inductor, default passes), with the eager optimizer: the user's own loop;
* ``spmd_backend_ddp_compiled_optimizer`` / ``spmd_backend_fsdp_compiled_optimizer``: the same loop
  with ``torch.compile(optimizer.step)`` (torch's compiled-optimizer recipe, on the DTensor
  parameters): the optimizer's update in a few fused kernels instead of eager DTensor foreach ops;
* ``torch_compile_ddp``: ``torch.compile`` of the DDP module (DDPOptimizer splits the graph at buckets);
* (no ``torch.compile`` of an FSDP2 model: compiling it in the same process sent the spmd backend
  variant's ``GPT.forward`` frames to eager in later rounds; Dynamo's per-code-object state is shared
  by every copy of the model);
* ``local_floor``: one process over the *local* batch, no communication: the compute floor (a rank
  cannot step faster than its own compute; hidden communication reaches it).

After warm-up (compilation), ``--rounds`` rounds run one step of every variant each, in a fixed
interleaved order after a barrier, so every variant sees the same machine load; times are medians
(p10/p90 too) of rank 0's wall time per step. Prints one JSON object: per config, per variant the
times, the ratios to torch_ddp / torch_fsdp2 / local_floor, and the collectives per step of the spmd
variants. Run: ``python bench/step_time.py [--config demo|large|both] [--rounds 20] [--only a,b]``.
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

CONFIGS = {
    # The demo's GPT (spmd-expand train defaults) and a larger one where compute dominates.
    "demo": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=96, batch=16),
    "large": dict(n_layer=4, n_head=8, n_embd=256, block_size=128, vocab_size=96, batch=16),
}
WORLD = 2
WARMUP = 2


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)


def _eager_step(model, optimizer, x, y, optimizer_step=None):
    """One step of the user's own loop; ``optimizer_step``: what updates (default ``optimizer.step``)."""
    loss = model(x, y)
    loss.backward()
    (optimizer_step or optimizer.step)()
    optimizer.zero_grad()
    return loss


def _variants(base, config, rank):
    """name -> (step closure over its own model copy, spmd CompiledStep or None)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1)
    x = torch.randint(0, config["vocab_size"], (config["batch"], config["block_size"]))
    y = torch.randint(0, config["vocab_size"], (config["batch"], config["block_size"]))
    local = config["batch"] // WORLD
    xl, yl = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    variants = {}
    for plan_name in ("ddp", "fsdp"):
        for passes, suffix in (("default", ""), ([], "_nopasses")):
            model = copy.deepcopy(base)
            optimizer = _optimizer(model)
            mesh = preset_mesh(plan_name, (WORLD,), "cpu")
            step = spmd.compile(mesh=mesh, plan=preset(plan_name).build(model), passes=passes)(language_model_step)
            variants[f"spmd_{plan_name}{suffix}"] = ((lambda s=step, m=model, o=optimizer: s(m, o, xl, yl)), step)
    for plan_name in ("ddp", "fsdp"):
        for compile_optimizer, suffix in ((False, ""), (True, "_compiled_optimizer")):
            model = copy.deepcopy(base)
            mesh = preset_mesh(plan_name, (WORLD,), "cpu")
            plan = preset(plan_name).build(model)
            spmd.parallelize(model, mesh, plan)
            compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan})
            optimizer = _optimizer(model)
            optimizer_step = torch.compile(optimizer.step) if compile_optimizer else optimizer.step
            variants[f"spmd_backend_{plan_name}{suffix}"] = (
                (lambda m=compiled, o=optimizer, s=optimizer_step: _eager_step(m, o, xl, yl, s)), None
            )
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model)
    optimizer = _optimizer(ddp)
    variants["torch_ddp"] = ((lambda m=ddp, o=optimizer: _eager_step(m, o, xl, yl)), None)
    model = copy.deepcopy(base)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = _optimizer(model)
    variants["torch_fsdp2"] = ((lambda m=model, o=optimizer: _eager_step(m, o, xl, yl)), None)
    model = copy.deepcopy(base)
    compiled = torch.compile(DistributedDataParallel(model))
    optimizer = _optimizer(model)
    variants["torch_compile_ddp"] = ((lambda m=compiled, o=optimizer: _eager_step(m, o, xl, yl)), None)
    model = copy.deepcopy(base)
    optimizer = _optimizer(model)
    variants["local_floor"] = ((lambda m=model, o=optimizer: _eager_step(m, o, xl, yl)), None)
    return variants


BASELINES = ("torch_ddp", "torch_fsdp2", "local_floor", "spmd_ddp", "spmd_fsdp")


def worker(rank: int, world: int, config_name: str, rounds: int, only: tuple = ()) -> dict:
    # Several copies of the same GPT are compiled in this process: Dynamo's per-code-object recompile
    # limit (8) would otherwise send later copies' frames to eager.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    config = CONFIGS[config_name]
    gpt = GPTConfig(**{k: config[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")})
    base = build_gpt(gpt, seed=0)
    variants = _variants(base, config, rank)
    if only:
        variants = {k: v for k, v in variants.items() if k in set(only) | set(BASELINES)}
    times, warmup_s = time_interleaved({name: run for name, (run, _) in variants.items()}, rounds, WARMUP)
    result = {"config": config, "rounds": rounds, "variants": {}}
    for name, samples in times.items():
        entry = {**summary(samples), "warmup_s": warmup_s[name]}
        step = variants[name][1]
        if step is not None:
            entry["collectives_per_step"] = step.last.collectives().as_dict()
        result["variants"][name] = entry
    medians = {n: v["median_ms"] for n, v in result["variants"].items()}
    for name, entry in result["variants"].items():
        for baseline in BASELINES:
            entry[f"ratio_to_{baseline}"] = medians[name] / medians[baseline]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("demo", "large", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated variants to run (the baselines always run)")
    args = parser.parse_args()
    names = ("demo", "large") if args.config == "both" else (args.config,)
    out = {"world_size": WORLD, "threads_per_rank": 1, "torch": torch.__version__}
    for name in names:
        only = tuple(v for v in args.only.split(",") if v)
        out[name] = run_local(worker, WORLD, name, args.rounds, only, timeout_s=3600)[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
