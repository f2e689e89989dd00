"""Train steps that draw random numbers (dropout, noise injection, sampling), and the rank worker
that compares them with one device.

The single-device reference and the compiled step each run from their own copy of the global CPU
generator, both starting from the same seed, so each sees exactly the generator state it would see
alone; at the end the worker also reports whether both copies advanced alike.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd_expand as spmd
from spmd_expand.app.models import GPTConfig, build_gpt, classification_step, language_model_step
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice

import cases

GLOBAL_BATCH = 8
SEED = 1234


class DropoutMLP(nn.Module):
    """``fc1`` -> ReLU -> dropout -> ``fc2`` (names match :meth:`spmd_expand.app.models.MLP.tensor_parallel_plan`)."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class NoiseMLP(nn.Module):
    """Noise injection with factory ops in forward: ``torch.randn`` sized by the batch, ``torch.rand_like``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.1 * torch.randn(x.shape[0], 16)
        h = F.relu(self.fc1(x))
        return self.fc2(h * (0.5 + torch.rand_like(h)))


class SamplingMLP(nn.Module):
    """Draws that read their inputs' values (``bernoulli(probs)``, ``normal(mean)``, randomized leaky
    ReLU, whose number of draws depends on the signs of its input) and fills of a shape carrier
    (Gumbel noise from ``empty_like(...).exponential_()``, ``uniform_``, a per-row ``bernoulli_``
    keep mask as in stochastic depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        probs = torch.sigmoid(h)
        # Straight-through binary units: the forward value is a sample, the gradient that of probs.
        h = probs + (torch.bernoulli(probs) - probs).detach()
        h = h + 0.01 * torch.normal(h.detach(), 1.0)
        gumbel = -torch.empty_like(h).exponential_().log()
        h = h + 0.1 * gumbel + 0.1 * torch.empty_like(h).uniform_(-1, 1)
        keep = torch.empty(h.shape[0], 1).bernoulli_(0.8)  # stochastic depth: drop whole rows
        return self.fc2(F.rrelu(h, training=True) * keep / 0.8)


GPT_DROPOUT = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=0.2)


@dataclass
class Case:
    model: Callable[[], nn.Module]
    optimizer: str
    batch: Callable[[torch.Generator], tuple]
    step: Callable
    tp: Optional[dict] = None


# Plain SGD keeps no optimizer state, so each case compiles once (the random ops do not depend on
# the optimizer); the GPT runs AdamW, whose states are compared too.
CASES: dict[str, Case] = {
    "mlp_dropout": Case(DropoutMLP, "sgd", cases._xy, classification_step, cases.MLP_TP),
    "mlp_dropout_microbatch": Case(DropoutMLP, "sgd", cases._xy, cases.microbatch_step),
    "noise": Case(NoiseMLP, "sgd", cases._xy, classification_step, cases.MLP_TP),
    "sampling": Case(SamplingMLP, "sgd", cases._xy, classification_step),
    "gpt_dropout": Case(lambda: build_gpt(GPT_DROPOUT, seed=0), "adamw_gpt", cases._tokens, language_model_step,
                        build_gpt(GPT_DROPOUT).tensor_parallel_plan()),
}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(name: str, mesh, plan: str, steps: int, lower: str) -> dict:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.model()
    reference = copy.deepcopy(model)
    optimizer = cases.OPTIMIZERS[case.optimizer](model.parameters())
    ref_optimizer = cases.OPTIMIZERS[case.optimizer](reference.parameters())
    plan_obj = cases.PLANS[plan][1](case.tp)
    step = spmd.compile(mesh=mesh, plan=plan_obj, lower=lower)(case.step)
    resolved = resolve_plan(plan_obj, mesh, model)

    torch.manual_seed(SEED)
    ref_rng = spmd_rng = torch.get_rng_state()
    losses, ref_losses = [], []
    for i in range(steps):
        batch = case.batch(torch.Generator().manual_seed(100 + i))
        torch.set_rng_state(ref_rng)
        ref_losses.append(case.step(reference, ref_optimizer, *batch).detach())
        ref_rng = torch.get_rng_state()
        local = [local_slice(t, mesh, resolved.batch_placements(t)) for t in batch]
        torch.set_rng_state(spmd_rng)
        losses.append(step(model, optimizer, *local).detach())
        spmd_rng = torch.get_rng_state()
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "states": {f"{k}.{s}": _full(t).clone() for k, p in model.named_parameters() for s, t in optimizer.state[p].items() if isinstance(t, torch.Tensor)},
        "ref_states": {f"{k}.{s}": t.clone() for k, p in reference.named_parameters() for s, t in ref_optimizer.state[p].items() if isinstance(t, torch.Tensor)},
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "generator_in_step": torch.equal(ref_rng, spmd_rng),
        "generator": spmd_rng,
    }


def run_random_cases(rank: int, world: int, runs: list[tuple[str, str]], lower: str = "eager", steps: int = 4) -> dict:
    """Worker: each ``(plan, case name)`` of ``runs`` on this rank, keyed ``"plan/name"``; errors are
    returned per run, not raised."""
    meshes: dict = {}
    results = {}
    for plan, name in runs:
        key = f"{plan}/{name}"
        try:
            start = time.perf_counter()
            if plan not in meshes:
                meshes[plan] = cases.make_mesh(plan, world)
            results[key] = run_case(name, meshes[plan], plan, steps, lower)
            results[key]["seconds"] = time.perf_counter() - start  # reported, never asserted
        except Exception:  # noqa: BLE001 - reported per run by the test
            results[key] = {"error": traceback.format_exc()}
    return results
