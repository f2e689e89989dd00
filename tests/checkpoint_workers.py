"""Rank workers for the checkpoint tests (module level: ranks are spawned and import them)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict, set_state_dict
import cases
import spmd_expand as spmd
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice

STEPS_BEFORE, STEPS_AFTER = 2, 2
CASE = cases.CASES["mlp_uneven"]  # uneven Shard(0) on purpose: resharding must undo the padding


def _fresh(mesh, plan: str):
    torch.manual_seed(0)
    model = CASE.model()
    optimizer = cases.OPTIMIZERS[CASE.optimizer](model.parameters())
    step = spmd.compile(mesh=mesh, plan=cases.PLANS[plan][1](CASE.tp), lower="eager")(CASE.step)
    return model, optimizer, step


def _batch(i: int, mesh, plan: str):
    """This rank's part of global batch i under the plan's batch placements."""
    placements = resolve_plan(cases.PLANS[plan][1](CASE.tp), mesh, CASE.model()).batch_placements
    return [local_slice(t, mesh, placements(t)) for t in CASE.batch(torch.Generator().manual_seed(100 + i))]


def train_and_save(rank: int, world: int, path: str, plan: str = "fsdp") -> dict:
    """Train STEPS_BEFORE steps, save a sharded checkpoint, train STEPS_AFTER more (the uninterrupted run)."""
    mesh = cases.make_mesh(plan, world)
    model, optimizer, step = _fresh(mesh, plan)
    for i in range(STEPS_BEFORE):
        step(model, optimizer, *_batch(i, mesh, plan))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full_model, full_optim = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    losses = [float(step(model, optimizer, *_batch(i, mesh, plan))) for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    return {
        "losses_after": losses,
        "full_model": {k: v.clone() for k, v in full_model.items()},
        "full_optim_keys": sorted(full_optim["state"].keys()) if full_optim else [],
        "full_model_is_plain": all(type(v) is torch.Tensor for v in full_model.values()),
    }


def load_and_continue(rank: int, world: int, path: str, plan: str) -> dict:
    """Load the checkpoint into a fresh compiled model (any world size, any plan) and continue."""
    mesh = cases.make_mesh(plan, world)
    model, optimizer, step = _fresh(mesh, plan)
    step.prepare(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # creates optimizer state to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [float(step(model, optimizer, *_batch(i, mesh, plan))) for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    return {"losses_after": losses}


def load_full_before_first_call(rank: int, world: int, full_model: dict) -> dict:
    """The usual "load pretrained weights, then train" flow: a full state dict into a plain model."""
    mesh = cases.make_mesh("fsdp", world)
    model, optimizer, step = _fresh(mesh, "fsdp")
    set_model_state_dict(model, full_model, options=StateDictOptions(full_state_dict=True))
    loss = float(step(model, optimizer, *_batch(0, mesh, "fsdp")))
    params = {k: v.full_tensor() for k, v in model.named_parameters()}
    return {"loss": loss, "params": params}
