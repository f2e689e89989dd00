"""Peak live bytes per rank of the GPT train step with and without activation checkpointing.

For W in (2, 8), under ``spmd.DDP`` and ``spmd.FSDP``, the demo GPT (``spmd_expand.app.models``) with
``GPTConfig.activation_checkpointing`` = ``"none"`` (the baseline, same run), ``"full"`` (every block
under ``checkpoint(use_reentrant=False)``) and ``"selective"`` (matmul and attention outputs saved,
pointwise ops recomputed) is compiled on torch's fake process group (only graphs, no numbers), and a
liveness walk over this rank's lowered local graph (``graph_stats.live_bytes``: fx graph order; each
value live from its node to its last use; views alias their base) gives:

* ``inputs_bytes``: parameters, gradients, optimizer states and batch (live throughout);
* ``peak_live_bytes``: the peak, inputs included; ``peak_activation_bytes`` = peak - inputs;
* ``peak_forward_backward_bytes``: the peak up to the last backward node (the optimizer's update,
  whose temporaries checkpointing does not touch, left out);
* ``saved_for_backward_bytes``: bytes live (inputs excluded) when the first backward node runs,
  i.e. what forward leaves for backward;
* ``recomputed_ops``: forward ops (GELU, LayerNorm, addmm, attention) that backward runs again;
* ratios against ``"none"`` of the same plan and W.

Prints one JSON object. Run: ``python bench/activation_memory.py [--layers 4]``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd_expand as spmd
from spmd_expand.app.models import GPTConfig, build_gpt
from spmd_expand.app.models import language_model_step as step
from spmd_expand.graph_stats import live_bytes
from spmd_expand.trace import backward_index

BATCH, BLOCK, WIDTH, VOCAB = 16, 64, 128, 64
MODES = ("none", "full", "selective")
aten = torch.ops.aten
# Forward ops that the backward of an uncheckpointed step never runs (its matmuls are mm, not addmm).
_FORWARD_OPS = {aten.gelu.default, aten.native_layer_norm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


def measure(world: int, plan_name: str, mode: str, layers: int) -> dict:
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))
        config = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=layers, n_head=4, n_embd=WIDTH, activation_checkpointing=mode)
        model = build_gpt(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        plan = {"ddp": spmd.DDP, "fsdp": spmd.FSDP}[plan_name]()
        compiled = spmd.compile(mesh=mesh, plan=plan, lower="eager")(step)
        idx = torch.randint(0, VOCAB, (BATCH // world, BLOCK))
        for _ in range(2):  # second call: steady state, optimizer states exist
            compiled(model, optimizer, idx, idx)
        gm = compiled.last.local_graph  # nodes carry meta["val"] of this rank's local shapes
        nodes = list(gm.graph.nodes)
        missing = [n.name for n in nodes if n.op in ("placeholder", "call_function") and "val" not in n.meta]
        assert not missing, f"nodes without meta['val']: {missing[:5]}"
        inputs, live = live_bytes(gm)
        in_backward = [i for i, n in enumerate(nodes) if backward_index(n) is not None]
        recomputed: dict[str, int] = {}
        for n in nodes:
            if backward_index(n) is not None and n.target in _FORWARD_OPS:
                recomputed[str(n.target)] = recomputed.get(str(n.target), 0) + 1
        peak = max([inputs, *live])
        return {
            "inputs_bytes": inputs,
            "peak_live_bytes": peak,
            "peak_activation_bytes": peak - inputs,
            "peak_forward_backward_bytes": max(live[: in_backward[-1] + 1]),
            "saved_for_backward_bytes": live[in_backward[0]] - inputs,
            "recomputed_ops": recomputed,
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    report = {
        "model": {"layers": args.layers, "n_embd": WIDTH, "block": BLOCK, "global_batch": BATCH, "vocab": VOCAB},
        "results": {},
    }
    for plan_name in ("ddp", "fsdp"):
        for world in (2, 8):
            rows = {mode: measure(world, plan_name, mode, args.layers) for mode in MODES}
            base = rows["none"]
            for mode in MODES[1:]:
                rows[mode]["peak_ratio_vs_none"] = round(rows[mode]["peak_live_bytes"] / base["peak_live_bytes"], 3)
                rows[mode]["peak_activation_ratio_vs_none"] = round(rows[mode]["peak_activation_bytes"] / base["peak_activation_bytes"], 3)
                rows[mode]["peak_forward_backward_ratio_vs_none"] = round(rows[mode]["peak_forward_backward_bytes"] / base["peak_forward_backward_bytes"], 3)
                rows[mode]["saved_ratio_vs_none"] = round(rows[mode]["saved_for_backward_bytes"] / base["saved_for_backward_bytes"], 3)
            report["results"][f"{plan_name}_w{world}"] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
