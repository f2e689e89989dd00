"""Workers for meta-device initialization and mixed FSDP/DDP plans, each against one device.

A model built under ``torch.device("meta")`` is distributed without values (meta DTensors of the
local shapes), ``to_empty``-ed, loaded from the reference model's full state dict (or from a
``torch.distributed.checkpoint`` of it) into its shards, and trained with AdamW; the reference
trains on one device over the global batch.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import spmd_expand as spmd
from spmd_expand.app.models import GPT, build_gpt, classification_step, language_model_step
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice

from cases import GPT_CONFIG

STEPS = 3
PLANS = {
    "ddp": spmd.DDP,
    "fsdp": spmd.FSDP,
    # FSDP on the transformer blocks, DDP on the embeddings, final norm and (tied) head.
    "fsdp_blocks": lambda: spmd.FSDP(modules=["layers.*"]),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tokens(i: int):
    g = torch.Generator().manual_seed(100 + i)
    idx = torch.randint(0, GPT_CONFIG.vocab_size, (8, 8), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _meta_gpt_loaded_from(reference, distribute, checkpoint: str | None = None) -> tuple[GPT, dict]:
    """Build a GPT on meta, ``distribute`` it, record its parameters (meta DTensors of local shapes
    expected), ``to_empty``, then load ``reference``'s weights into the shards: from its full state
    dict, or (``checkpoint``: a folder all ranks share) from a ``torch.distributed.checkpoint`` of it."""
    with torch.device("meta"):
        model = GPT(GPT_CONFIG)
    distribute(model)
    seen = {
        fqn: (type(p).__name__, p.device.type, p.to_local().device.type, tuple(p.to_local().shape), tuple(p.shape), p.placements)
        for fqn, p in model.named_parameters()
    }
    model.to_empty(device="cpu")
    if checkpoint is None:
        full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    else:
        dcp.save(reference.state_dict(), checkpoint_id=checkpoint)  # plain tensors: saved once
        sharded = get_model_state_dict(model)  # DTensor shards, read in place by dcp.load
        dcp.load(sharded, checkpoint_id=checkpoint)
        set_model_state_dict(model, sharded)
    return model, seen


def _result(model, reference, losses, ref_losses, seen) -> dict:
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "placements": {k: tuple(v.placements) for k, v in model.named_parameters()},
        "meta": seen,
    }


def compiled_step(plan_name: str, mesh, checkpoint: str | None = None) -> dict:
    """``spmd.compile`` path: ``CompiledStep.prepare`` on the meta model."""
    plan = PLANS[plan_name]()
    reference = build_gpt(GPT_CONFIG, seed=0)
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(language_model_step)
    model, seen = _meta_gpt_loaded_from(reference, step.prepare, checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    resolved = resolve_plan(plan, mesh, reference)
    losses, ref_losses = [], []
    for i in range(STEPS):
        batch = _tokens(i)
        local = [local_slice(t, mesh, resolved.batch_placements(t)) for t in batch]
        losses.append(step(model, optimizer, *local).detach())
        ref_losses.append(language_model_step(reference, ref_optimizer, *batch).detach())
    return _result(model, reference, losses, ref_losses, seen)


def torch_compile_loop(plan_name: str, mesh) -> dict:
    """``torch.compile(backend="spmd")`` path: ``spmd.parallelize`` on the meta model, eager loop."""
    torch._dynamo.reset()
    plan = PLANS[plan_name]()
    reference = build_gpt(GPT_CONFIG, seed=0)
    model, seen = _meta_gpt_loaded_from(reference, lambda m: spmd.parallelize(m, mesh, plan))
    compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan, "lower": "eager"})
    resolved = resolve_plan(plan, mesh, reference)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    losses, ref_losses = [], []
    for i in range(STEPS):
        batch = _tokens(i)
        local = [local_slice(t, mesh, resolved.batch_placements(t)) for t in batch]
        for fn, args, out, opt in ((compiled, local, losses, optimizers[0]), (reference, batch, ref_losses, optimizers[1])):
            idx, targets = args
            loss = F.cross_entropy(fn(idx).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
    return _result(model, reference, losses, ref_losses, seen)


def _meta_linear_initialized(mesh, plan) -> dict:
    """A ``Linear(8, 6)`` built on meta, parallelized with ``plan``, materialized and initialized
    from seed 0: each rank's local parameter values."""
    with torch.device("meta"):
        model = torch.nn.Linear(8, 6)
    spmd.parallelize(model, mesh, plan)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    return {k: v.to_local().clone() for k, v in model.named_parameters()}


def random_init(mesh) -> dict:
    """What DTensor random init gives on a CPU mesh: each rank's local values (no RNG tracker)."""
    return {"replicated": _meta_linear_initialized(mesh, spmd.DDP()), "sharded": _meta_linear_initialized(mesh, spmd.FSDP())}


def replicated_broadcast_before_first_step(mesh, path: str) -> dict:
    """Randomly initialized shards that draw different counts of numbers on different ranks (5 rows
    on 2 ranks: 3 and 2) leave the replicated layer after them different across ranks; the first
    step (``spmd.compile``) or compilation (``torch.compile``) broadcasts it from rank 0."""
    torch._dynamo.reset()
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    plan = spmd.FSDP(modules=["0"])
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(classification_step)
    if path == "compile":
        step.prepare(model)
    else:
        spmd.parallelize(model, mesh, plan)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    before = {k: v.to_local().clone() for k, v in model[2].named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves values as they are
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(4, dtype=torch.long)
    if path == "compile":
        step(model, optimizer, x, y)
    else:
        compiled = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan, "lower": "eager"})
        F.cross_entropy(compiled(x), y).backward()
    return {"before": before, "after": {k: v.to_local().clone() for k, v in model[2].named_parameters()}}


def run(rank: int, world: int, runs: list[tuple[str, str]], checkpoint_root: str) -> dict:
    """Worker: each (path, plan) on this rank; errors are returned per run, not raised.
    ``checkpoint_root``: a folder all ranks share, for the ``compile_dcp`` path."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for path, plan_name in runs:
        try:
            if path == "random_init":
                results[(path, plan_name)] = random_init(mesh)
            elif path.startswith("replicated_broadcast_"):
                results[(path, plan_name)] = replicated_broadcast_before_first_step(mesh, path.removeprefix("replicated_broadcast_"))
            elif path == "compile_dcp":
                results[(path, plan_name)] = compiled_step(plan_name, mesh, os.path.join(checkpoint_root, plan_name))
            else:
                fn = compiled_step if path == "compile" else torch_compile_loop
                results[(path, plan_name)] = fn(plan_name, mesh)
        except Exception:  # noqa: BLE001 - reported per run by the test
            results[(path, plan_name)] = {"error": traceback.format_exc()}
    return results
