"""Peak memory per rank of initializing a model: meta-device flow against materializing it first.

A GPT of about 300 MB of fp32 parameters (L=6, d=1024) on W=2 gloo ranks, each variant in fresh
rank processes (``run_local`` spawns new ones per variant):

* ``fsdp_meta``: build under ``torch.device("meta")``, ``spmd.parallelize(model, mesh, spmd.FSDP())``
  (meta DTensors, no values), ``model.to_empty(device="cpu")`` (allocates only the local shards),
  then initialize in place (``reset_parameters()`` and the GPT's normal init, on the DTensor shards);
* ``fsdp_materialized``: build the full model on CPU (initialized), then ``spmd.parallelize`` (each
  rank keeps its shard of rank 0's values; the full copy is freed afterwards);
* ``ddp_meta``: the meta flow under ``spmd.DDP()``: every rank holds the full (replicated) model.

Measured per rank: ``peak_rss_delta_mb``, the process's peak resident memory (``ru_maxrss``) after
initialization minus its resident memory (``/proc/self/statm``) just before the model is built, so
imports and the process group are outside it; and ``local_param_mb``, the bytes of this rank's local
parameter tensors counted after initialization (what the shards need, without allocator overhead).
``ratio_to_materialized`` divides each variant's peak delta by ``fsdp_materialized``'s, rank by rank.

Prints one JSON object. Run: ``python bench/meta_init.py > bench/results/meta_init.json`` (~1 min).
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=128, block_size=256, n_layer=6, n_head=16, n_embd=1024)
WORLD = 2
MB = 2**20


def _rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _initialize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        model.apply(GPT._init_weights)


def worker(rank: int, world: int, variant: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    plan = spmd.DDP() if variant.startswith("ddp") else spmd.FSDP()
    torch.manual_seed(0)
    before = _rss_now_bytes()
    if variant.endswith("_meta"):
        with torch.device("meta"):
            model = GPT(CONFIG)
        spmd.parallelize(model, mesh, plan)
        model.to_empty(device="cpu")
        _initialize(model)
    else:
        model = GPT(CONFIG)
        spmd.parallelize(model, mesh, plan)
    peak = _peak_rss_bytes()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    return {
        "peak_rss_delta_mb": round((peak - before) / MB, 1),
        "local_param_mb": round(local / MB, 1),
        "full_param_mb": round(full / MB, 1),
    }


def main() -> None:
    results = {}
    for variant in ("fsdp_meta", "fsdp_materialized", "ddp_meta"):
        results[variant] = run_local(worker, WORLD, variant, timeout_s=1200)
        print(f"meta_init: {variant}: {results[variant]}", file=sys.stderr)
    for variant, per_rank in results.items():
        for row, base in zip(per_rank, results["fsdp_materialized"]):
            row["ratio_to_materialized"] = round(row["peak_rss_delta_mb"] / base["peak_rss_delta_mb"], 3)
    print(json.dumps({"config": vars(CONFIG), "world_size": WORLD, "variants": results}, indent=2))


if __name__ == "__main__":
    main()
