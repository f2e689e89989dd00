"""FSDP memory and communication of the GPT train step, per rank, on torch's fake process group.

For W in (1, 2, 4, 8), with ``spmd.FSDP`` (``reshard_after_forward`` None: the default, blocks
re-gathered and the root block kept; True; False) and ``spmd.DDP`` as the reference in the same run:

* persistent bytes per rank: local parameter + optimizer-state bytes after a step, and the bytes of
  the reduced gradient the step hands to the optimizer (its reduce-scatter / all-reduce output);
  ``fraction_of_single_device`` should be about 1/W for FSDP (plus padding of uneven dims);
* peak live bytes of the expanded graph, from a liveness walk (``graph_stats.peak_live_bytes``);
* communication volume per step: bytes of the tensors gathered (all_gather outputs) and reduced
  (reduce_scatter inputs), against the textbook figure: every parameter gathered once in forward,
  once more in backward where resharded, and every gradient reduce-scattered once (ZeRO-3,
  Rajbhandari et al. 2020). With resharding, parameters that backward never reads (biases, the
  position embedding) are not gathered again, so the ratio is below 1.00; without it it is 1.00.

Prints one JSON object. Run: ``python bench/fsdp_memory.py [--layers 4]``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_expand as spmd
from spmd_expand.graph_stats import peak_live_bytes
from spmd_expand.app.models import GPTConfig, build_gpt
from spmd_expand.app.models import language_model_step as step

C10D = torch.ops._c10d_functional
BATCH, BLOCK = 16, 32


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure(world: int, plan, layers: int) -> dict:
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = build_gpt(GPTConfig(vocab_size=64, block_size=BLOCK, n_layer=layers, n_head=4, n_embd=64))
        full_param_bytes = sum(_bytes(p) for p in model.parameters())
        # Gathered again for backward (FSDP's default: the blocks' parameters, not the root block's).
        resharded = sum(_bytes(p) for fqn, p in model.named_parameters() if plan.reshards_after_forward(fqn))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        compiled = spmd.compile(mesh=mesh, plan=plan, lower="eager")(step)
        idx = torch.randint(0, 64, (BATCH // world, BLOCK))
        for _ in range(2):  # second call: steady state, optimizer states exist
            compiled(model, optimizer, idx, idx)
        gm = compiled.last.local_graph
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        params = sum(_bytes(local(p)) for p in model.parameters())
        states = sum(_bytes(local(v)) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        # The local graph's nodes carry their local values (meta["val"]) from expansion and the passes.
        grads = gathered = reduced = 0
        for n in gm.graph.nodes:
            # (after the bucketing pass an all-gather bucket writes into a buffer: the _out form)
            if n.target in (C10D.all_gather_into_tensor.default, C10D.all_gather_into_tensor_out.default) and n.meta["val"].dim() > 0:
                gathered += _bytes(n.meta["val"])
            elif n.target is C10D.reduce_scatter_tensor.default:
                reduced += _bytes(n.args[0].meta["val"])
                grads += _bytes(n.meta["val"])
            elif n.target is C10D.all_reduce.default and n.meta["val"].dim() > 0:
                reduced += _bytes(n.args[0].meta["val"])
                grads += _bytes(n.meta["val"])
        if world == 1:  # a 1-rank mesh needs no collective: the gradient is the full one
            grads = full_param_bytes
        # Gathered in forward, again in backward where resharded, reduced once.
        expected = full_param_bytes + resharded + full_param_bytes
        return {
            "world_size": world,
            "persistent_bytes": {"params": params, "grads": grads, "optimizer_states": states, "total": params + grads + states},
            "single_device_persistent_bytes": full_param_bytes * 4 + sum(
                _bytes(local(v)) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 0
            ),
            "peak_live_bytes": peak_live_bytes(gm)["peak"],
            "comm_bytes_per_step": {"all_gather": gathered, "reduce": reduced, "total": gathered + reduced},
            "textbook_fsdp_comm_bytes": expected if world > 1 else 0,
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    plans = {
        "fsdp_default": spmd.FSDP(),
        "fsdp_reshard": spmd.FSDP(reshard_after_forward=True),
        "fsdp_keep": spmd.FSDP(reshard_after_forward=False),
        "ddp": spmd.DDP(),
    }
    report = {"layers": args.layers, "batch": BATCH, "block": BLOCK, "results": {}}
    for name, plan in plans.items():
        rows = []
        for world in (1, 2, 4, 8):
            row = measure(world, plan, args.layers)
            single = row.pop("single_device_persistent_bytes")
            row["fraction_of_single_device"] = row["persistent_bytes"]["total"] / single
            if row["textbook_fsdp_comm_bytes"] and name != "ddp":
                row["comm_ratio_measured_over_textbook"] = row["comm_bytes_per_step"]["total"] / row["textbook_fsdp_comm_bytes"]
            rows.append(row)
        report["results"][name] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
