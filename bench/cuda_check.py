"""Parity of the compiled step on CUDA (NCCL, Inductor's Triton code) against one device.

Run on a machine with a GPU::

    python bench/cuda_check.py --out results.json [--cases ddp,fsdp,...] [--world 1]

Each case trains the project's GPT (``GPTConfig`` below) for ``--steps`` AdamW steps twice on
``cuda``: once eagerly on one device over the global batch (the reference), once compiled with
``spmd.compile`` (or ``torch.compile(backend="spmd")``) on ``--world`` ranks, each on its shard of
that batch, joined by NCCL when the world has one rank per GPU (else gloo over the same GPU). It
records the largest difference of the losses and of the trained parameters, the compile time of
the first call and the median time of the later calls (ms), and on error the traceback. Nothing in
the test suite needs it: the suite runs on CPU gloo ranks.

Needs the torch spmd_expand is built for (2.13) with CUDA. ``--device cpu`` runs the same cases on
gloo CPU ranks (how the script itself is checked where there is no GPU). The case ``fsdp_offload``
reports FSDP's PlanError until CPU offload is implemented for CUDA meshes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

import spmd_expand as spmd
from spmd_expand.app.data import shard
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import GPTConfig, build_gpt, language_model_step

CONFIG = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=128)
GLOBAL_BATCH, SEQ = 8, 64


def _plan(name: str):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if name.startswith("ddp"):
        return spmd.DDP()
    if name == "fsdp_bf16":
        return spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if name.startswith("fsdp_offload"):
        return spmd.FSDP(offload_policy=CPUOffloadPolicy())
    return spmd.FSDP()


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=g),
         torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=g))
        for _ in range(steps)
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reference(device: str, steps: int, bf16: bool) -> dict:
    model = build_gpt(CONFIG).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(steps):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            losses.append(language_model_step(model, opt, x.to(device), y.to(device)).item())
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _run_case(device: str, name: str, rank: int, world: int, steps: int) -> dict:
    mesh = init_device_mesh(device, (world,))
    model = build_gpt(CONFIG).to(device)
    times, losses = [], []
    if name.startswith("backend"):
        plan = _plan(name.removeprefix("backend_"))
        model = spmd.parallelize(model, mesh, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cmodel = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan})

        def step(x, y):
            loss = cmodel(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        lower = "eager" if name.endswith("_eager") else "inductor"
        compiled = spmd.compile(mesh=mesh, plan=_plan(name), lower=lower)(language_model_step)

        def step(x, y):
            return compiled(model, opt, x, y)

    for x, y in _batches(steps):
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        _sync(device)
        start = time.perf_counter()
        loss = step(x, y)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    devices = sorted({str(p.to_local().device if hasattr(p, "to_local") else p.device) for p in model.parameters()})
    state_devices = sorted(
        {str(v.to_local().device if hasattr(v, "to_local") else v.device)
         for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    )
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "first_call_s": times[0],
        "step_ms": 1e3 * statistics.median(times[1:]) if len(times) > 1 else None,
        "param_devices": devices,
        "state_devices": state_devices,
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    }


def worker(rank: int, world: int, device: str, cases: list[str], steps: int) -> dict:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    out = {}
    for name in cases:
        try:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            out[name] = _run_case(device, name, rank, world, steps)
        except Exception:  # noqa: BLE001 - a device check reports every case
            out[name] = {"error": traceback.format_exc()[-6000:]}
        torch._dynamo.reset()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="ddp,fsdp,fsdp_eager,fsdp_bf16,fsdp_offload,backend_fsdp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the check itself on gloo ranks")
    parser.add_argument("--out", default="cuda_check.json")
    args = parser.parse_args()
    cases, device = args.cases.split(","), args.device
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report = {"torch": torch.__version__, "device": name, "world": args.world, "cases": {}}
    refs = {bf16: _reference(device, args.steps, bf16) for bf16 in {c.endswith("bf16") for c in cases}}
    backend = "nccl" if device == "cuda" and args.world <= torch.cuda.device_count() else "gloo"
    results = run_local(worker, args.world, device, cases, args.steps, backend=backend, timeout_s=900)[0]
    for name, got in results.items():
        ref = refs[name.endswith("bf16")]
        if "error" not in got:
            got["loss_diff"] = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
            got["param_diff"] = max((got["params"][n] - p).abs().max().item() for n, p in ref["params"].items())
            got["ref_losses"] = ref["losses"]
        got.pop("params", None)
        report["cases"][name] = got
        print(name, json.dumps({k: v for k, v in got.items() if k != "error"}), got.get("error", ""), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
