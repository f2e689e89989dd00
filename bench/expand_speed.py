"""Expansion speed of the GPT train step versus re-tracing the step through DTensor.

For L in (4, 8, 16, 32) layers, on torch's fake process group of world size 8 (no real ranks):

* spmd_expand: the whole front end without Inductor: trace the global step (make_fx, 2 passes), the
  global passes and rank check, propagate placements, expand to the local graph, the default local
  passes (bucketing, overlap). Reported per stage (``trace_s``, ``propagate_s``, ``expand_s``,
  ``passes_s``: global and local passes and the rank check), propagate + expand together
  (``propagate_expand_s``, what earlier runs called ``expand_s``), the cyclic garbage collection owed
  after the compilation (``gc_after_s``: the pipeline keeps the collector off while it compiles), and
  end to end (``total_s``, that collection included).
  For ``--lower-layers`` (default 4 and 8: Inductor takes minutes at 32 layers) the local graph is
  also lowered with Inductor once, with its FX graph cache off (a cold compile): ``lower_s``, and
  ``total_with_lower_s`` = ``total_s`` + ``lower_s``.
* baseline: ``make_fx`` of the same step on DTensor-wrapped local tensors (``DTensor.from_local``),
  which records the local graph by running DTensor's dispatch (propagation + redistribution) op by op.

Prints one JSON object: per L the node counts, seconds, the ratio baseline / spmd_expand, and the time
growth per doubling of L. Run: ``python bench/expand_speed.py [--layers 4 8 16 32] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_expand as spmd
from spmd_expand.app.models import GPTConfig, build_gpt
from spmd_expand.app.models import language_model_step as step

WORLD = 8
BATCH, BLOCK = 16, 32


def ours(layers: int, mesh, lower: str = "eager") -> dict:
    model = build_gpt(GPTConfig(vocab_size=64, block_size=BLOCK, n_layer=layers, n_head=4, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    idx = torch.randint(0, 64, (BATCH // WORLD, BLOCK))
    compiled = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower=lower)(step)
    # Warm-up call: creates the optimizer state, so the measured compile is the steady-state graph.
    compiled(model, optimizer, idx, idx)
    compiled.reset()
    gc.collect()  # start each timed run with an empty cyclic-GC backlog (same for the baseline)
    compiled(model, optimizer, idx, idx)
    # The pipeline keeps the cyclic GC off while it compiles: the collection it owes runs afterwards.
    start = time.perf_counter()
    gc.collect()
    gc_after = time.perf_counter() - start
    s = compiled.last.seconds
    passes = s["global_passes"] + s["rank_check"] + s["local_passes"]
    if lower == "inductor":
        return {"lower_s": s["lower"]}
    return {
        "global_nodes": len(compiled.last.traced.graph_module.graph.nodes),
        "local_nodes": len(compiled.last.local_graph.graph.nodes),
        "trace_s": s["trace"],
        "propagate_s": s["propagate"],
        "expand_s": s["expand"],
        "passes_s": passes,
        "propagate_expand_s": s["propagate"] + s["expand"],
        "gc_after_s": gc_after,
        "total_s": s["trace"] + s["propagate"] + s["expand"] + passes + gc_after,
    }


def baseline(layers: int, mesh) -> dict:
    """make_fx of the step with parameters, states and batch as DTensors over local tensors."""
    model = build_gpt(GPTConfig(vocab_size=64, block_size=BLOCK, n_layer=layers, n_head=4, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    step(model, optimizer, torch.randint(0, 64, (2, BLOCK)), torch.randint(0, 64, (2, BLOCK)))  # create states
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    states = [{k: v.detach() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    idx = torch.randint(0, 64, (BATCH // WORLD, BLOCK))

    def local_step(params, states, idx):
        wrap = lambda t, pl: DTensor.from_local(t, mesh, pl, run_check=False)  # noqa: E731
        dparams = {n: nn.Parameter(wrap(p, [Replicate()])) for n, p in zip(names, params)}
        opt = copy.copy(optimizer)
        opt.state = {dparams[n]: {k: wrap(v, [Replicate()]) for k, v in s.items()} for n, s in zip(names, states)}
        opt.param_groups = [dict(g, params=list(dparams.values())) for g in optimizer.param_groups]
        # implicit_replication: plain tensors made inside the step (position ids) count as replicated.
        with stateless._reparametrize_module(model, dparams, tie_weights=True), implicit_replication():
            loss = step(model, opt, wrap(idx, [Shard(0)]), wrap(idx, [Shard(0)]))
        return loss.to_local(), [p.to_local() for p in dparams.values()]

    gc.collect()
    start = time.perf_counter()
    # Same optimizer code path as spmd_expand's trace: capturable (tensor `step`, no .item()).
    for group in optimizer.param_groups:
        group["capturable"] = True
    with torch.compiler._compile_session_context():
        gm = make_fx(local_step)(params, states, idx)
    return {"nodes": len(gm.graph.nodes), "total_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3, help="best of N for each measurement")
    parser.add_argument(
        "--lower-layers", type=int, nargs="*", default=[4, 8],
        help="layer counts whose local graph is also lowered with Inductor (cold: no FX graph cache), once",
    )
    args = parser.parse_args()
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = []
    for layers in args.layers:
        runs = [ours(layers, mesh) for _ in range(args.repeats)]
        # Best of N for each measure on its own (a slow trace must not hide a fast expansion).
        mine = {k: min(r[k] for r in runs) for k in runs[0]}
        if layers in args.lower_layers:
            with torch._inductor.config.patch(fx_graph_cache=False):
                mine.update(ours(layers, mesh, lower="inductor"))
            mine["total_with_lower_s"] = mine["total_s"] + mine["lower_s"]
        base = min((baseline(layers, mesh) for _ in range(args.repeats)), key=lambda r: r["total_s"])
        rows.append(
            {
                "layers": layers,
                "spmd_expand": mine,
                "baseline_dtensor_retrace": base,
                "ratio_total": base["total_s"] / mine["total_s"],
                "ratio_propagate_expand_only": base["total_s"] / mine["propagate_expand_s"],
            }
        )
    for prev, row in zip(rows, rows[1:]):
        doublings = math.log2(row["layers"] / prev["layers"])
        for key in ("total_s", "propagate_expand_s"):
            growth = row["spmd_expand"][key] / prev["spmd_expand"][key]
            row[f"growth_per_doubling_{key[:-2]}"] = growth ** (1 / doublings)
    print(json.dumps({"world_size": WORLD, "batch": BATCH, "block": BLOCK, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
