"""Fuzzed parity: seeded random small models and optimizers, compiled step vs one device.

:func:`random_case` builds, from one seed, a model out of Linear, LayerNorm, activations, residual
adds, reshape/transpose round trips, cat and reductions over widths that do not divide the world size,
an optimizer (SGD with or without momentum, Adam, AdamW), a loss reduction, and a tensor-parallel plan
(each Linear colwise, rowwise or replicated, at random). :func:`run_fuzz` is the rank worker: every
case under every plan (DDP, FSDP, TP), a few steps, parameters compared with the single-device run over
the global batch. Used by tests/test_fuzz.py (a bounded set) and bench/fuzz.py (thousands).
"""

from __future__ import annotations

import copy
import random
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_expand as spmd
from cases import _full
from spmd_expand.app.presets import preset
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice

WIDTHS = (3, 5, 6, 7, 9, 12)
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}
PLANS = ("ddp", "fsdp", "tp")  # 1-D, any world size
PLANS_2D = ("fsdp+tp", "ddp+tp", "hsdp")  # on a 2 x W/2 mesh (W >= 4, even)


class Block(nn.Module):
    """One random layer: ``kind`` decides what forward does with the activation ``(B, width_in)``."""

    def __init__(self, kind: str, width_in: int, width_out: int, rng: random.Random):
        super().__init__()
        self.kind = kind
        self.activation = rng.choice(sorted(ACTIVATIONS))
        if kind in ("linear", "residual", "cat"):
            self.fc = nn.Linear(width_in, width_out if kind != "cat" else width_out - width_in, bias=rng.random() < 0.7)
        elif kind == "norm":
            self.norm = nn.LayerNorm(width_in)
        elif kind == "transpose":
            self.fc = nn.Linear(width_in, width_in)
        elif kind == "rms":
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.activation]
        if self.kind == "linear":
            return act(self.fc(x))
        if self.kind == "residual":
            return x + act(self.fc(x))
        if self.kind == "cat":
            return torch.cat([x, act(self.fc(x))], dim=-1)
        if self.kind == "norm":
            return self.norm(x)
        if self.kind == "transpose":
            # (B, D) -> (B, D, 1) -> (B, 1, D) -> (B, D): a reshape/transpose round trip around a Linear.
            y = self.fc(x).unsqueeze(-1).transpose(1, 2).reshape(x.shape[0], -1)
            return act(y)
        if self.kind == "center":
            return x - x.mean(dim=-1, keepdim=True)
        if self.kind == "rms":
            # RMSNorm written out: a reduction over the features, a broadcast, a free parameter.
            return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * self.weight
        if self.kind == "pool":
            # A reduction across the batch (each row sees the others: a collective under DDP/FSDP) and
            # a max over the features. Added, not subtracted: x - x.mean(0) would make the gradient of
            # an earlier bias exactly zero in exact arithmetic and +-1e-8 in floats, which Adam
            # normalizes to +-lr on one side and not the other (seed 13 found this; not a bug).
            return x + 0.5 * x.mean(dim=0, keepdim=True) + act(x).amax(dim=-1, keepdim=True)
        raise ValueError(self.kind)


class RandomModel(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        width = rng.choice(WIDTHS)
        self.width_in = width
        blocks = []
        for _ in range(rng.randint(2, 5)):
            kind = rng.choice(("linear", "linear", "residual", "cat", "norm", "transpose", "center", "rms", "pool"))
            out = width if kind in ("residual", "norm", "transpose", "center", "rms", "pool") else rng.choice(WIDTHS)
            if kind == "cat":
                out = width + rng.choice(WIDTHS)
            blocks.append(Block(kind, width, out, rng))
            width = out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, rng.choice((2, 3, 5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass
class Case:
    seed: int
    model: Callable[[], nn.Module]
    optimizer: Callable[[list], torch.optim.Optimizer]
    reduction: str  # "mean" or "sum" of the per-row loss
    loss: str  # a key of LOSSES
    tp_plan: dict  # module FQN -> ColwiseParallel() / RowwiseParallel(), for plan "tp"
    description: str


def random_case(seed: int) -> Case:
    rng = random.Random(10_000 + seed)
    lr = rng.choice((1e-3, 1e-2, 5e-2))
    name = rng.choice(("sgd", "sgd_momentum", "adam", "adamw"))
    factories = {
        "sgd": lambda p: torch.optim.SGD(p, lr=lr),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=lr, foreach=True),
        "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1, foreach=True),
    }
    reduction = rng.choice(("mean", "sum"))

    def model() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return RandomModel(seed)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp_plan = {}
    for fqn, module in model().named_modules():
        if isinstance(module, nn.Linear):
            style = rng.choice(("colwise", "rowwise", "replicated"))
            if style != "replicated":
                tp_plan[fqn] = style
    # Drawn last, so the draws above (and the regression seeds' models) are as they were.
    loss = rng.choice(sorted(LOSSES))
    description = f"seed {seed}: {name} lr {lr}, loss {loss} {reduction}, tp {tp_plan}"
    return Case(seed, model, factories[name], reduction, loss, {k: styles[v]() for k, v in tp_plan.items()}, description)


def _one_hot(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.one_hot(y, o.shape[-1]).to(o.dtype)


# Losses of (logits, class targets, reduction); the regression ones compare one-hot targets.
LOSSES = {
    "cross_entropy": lambda o, y, r: F.cross_entropy(o, y, reduction=r),
    "mse": lambda o, y, r: F.mse_loss(o, _one_hot(o, y), reduction=r),
    "smooth_l1": lambda o, y, r: F.smooth_l1_loss(o, _one_hot(o, y), reduction=r),
    "bce_with_logits": lambda o, y, r: F.binary_cross_entropy_with_logits(o, _one_hot(o, y), reduction=r),
}


def _step(loss_name: str, reduction: str):
    def step(model, optimizer, x, y):
        loss = LOSSES[loss_name](model(x), y, reduction)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _plan(case: Case, name: str):
    tp = lambda: spmd.TensorParallel(case.tp_plan)  # noqa: E731
    return {
        "ddp": spmd.DDP,
        "fsdp": spmd.FSDP,
        "tp": tp,
        "fsdp+tp": lambda: {"dp": spmd.FSDP(), "tp": tp()},
        "ddp+tp": lambda: {"dp": spmd.DDP(), "tp": tp()},
        "hsdp": lambda: {"replicate": spmd.DDP(), "shard": spmd.FSDP()},
    }[name]()


# Relative size of the gradient perturbation that measures each element's roundoff sensitivity
# (:func:`compare_parameters`): ~8 float32 ulps of the gradient's root-mean-square, several times the
# roundoff of a sum taken in another order (what W ranks do to the global batch's gradient).
PERTURBATION = 1e-6
RTOL, ATOL = 1e-4, 1e-5


def _perturb_gradients(model: nn.Module, seed: int) -> None:
    """Add ``PERTURBATION`` x rms(grad) x N(0, 1) noise (seeded) to every nonzero element of every
    gradient of ``model``. An exact zero (an inactive unit's) stays zero: it is a sum of zeros in any
    order, so roundoff cannot move it, and a compiled step that moves it is wrong."""
    g = torch.Generator().manual_seed(seed)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(grad.shape, generator=g, dtype=grad.dtype) * (grad != 0)
        return grad + PERTURBATION * grad.square().mean().sqrt() * noise

    for p in model.parameters():
        p.register_hook(hook)


def global_batch(case: Case, model: nn.Module, world: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s global batch (``2 * world`` rows) of ``case``: inputs and class targets."""
    g = torch.Generator().manual_seed(1000 * case.seed + i)
    x = torch.randn(2 * world, model.width_in, generator=g)
    y = torch.randint(0, model.head.out_features, (2 * world,), generator=g)
    return x, y


def single_device_run(case: Case, world: int, steps: int = 2, perturbed: bool = False) -> nn.Module:
    """``case``'s model trained ``steps`` steps on one device over the global batches; ``perturbed``:
    with every gradient perturbed (:func:`_perturb_gradients`), to measure roundoff sensitivity."""
    model = case.model()
    if perturbed:
        _perturb_gradients(model, case.seed)
    optimizer, step = case.optimizer(list(model.parameters())), _step(case.loss, case.reduction)
    for i in range(steps):
        step(model, optimizer, *global_batch(case, model, world, i))
    return model


def compare_parameters(params: dict, reference: dict, perturbed: dict) -> tuple[Optional[str], float]:
    """Compare parameters (FQN -> full tensor) with the single-device run's and return (what differs,
    or None; the widening).

    An element must agree within ``ATOL + RTOL * |p| + S``, ``S`` its roundoff sensitivity: how far the
    ``perturbed`` run (every gradient moved by ``PERTURBATION`` of its rms) moved it. ``S`` is tiny
    except where the result amplifies a gradient's last bits, as Adam does to a gradient near its
    ``eps`` (``lr * g / (|g| + eps)`` has slope ``lr * eps / (|g| + eps)**2``: 2e5 for a gradient of
    4e-8 at lr 0.05), where the sum's order alone (W ranks instead of one) legitimately moves the
    parameter by more than ``RTOL``. A wrong answer (a missing reduction, a wrong scale) moves elements
    far more than their ``S``. The widening is the largest ``S / (ATOL + RTOL * |p|)``: how much looser
    than the fixed tolerance the comparison was, at its loosest element.
    """
    widening = 0.0
    for k, ref in reference.items():
        error = (params[k] - ref).abs()
        fixed = ATOL + RTOL * ref.abs()
        sensitivity = (perturbed[k] - ref).abs()
        widening = max(widening, (sensitivity / fixed).max().item())
        outside = error > fixed + sensitivity
        if outside.any():
            i = int((error - fixed - sensitivity).flatten().argmax())
            return (
                f"param {k} differs by {error.max().item():.2e} ({int(outside.sum())} of {ref.numel()} elements "
                f"outside tolerance; worst at flat index {i}: {error.flatten()[i].item():.2e}, roundoff "
                f"sensitivity there {sensitivity.flatten()[i].item():.2e})"
            ), widening
    return None, widening


def run_case(case: Case, plan_name: str, mesh, rank: int, world: int, steps: int = 2) -> dict:
    """Train ``case`` for ``steps`` steps compiled under ``plan_name`` and on one device over the global
    batch; compare losses (relative 1e-4) and parameters (:func:`compare_parameters`)."""
    model = case.model()
    reference = copy.deepcopy(model)
    plan = _plan(case, plan_name)
    resolved = resolve_plan(plan, mesh, model)
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(_step(case.loss, case.reduction))
    reference_step = _step(case.loss, case.reduction)
    optimizer, ref_optimizer = case.optimizer(list(model.parameters())), case.optimizer(list(reference.parameters()))
    worst = 0.0
    compiled_s = reference_s = 0.0
    for i in range(steps):
        x, y = global_batch(case, model, world, i)
        # This rank's part of the global batch under the plan (data-parallel dims split it, TP shares it).
        local = [local_slice(t, mesh, resolved.batch_placements(t)) for t in (x, y)]
        start = time.perf_counter()
        loss = step(model, optimizer, *local)
        middle = time.perf_counter()
        ref_loss = reference_step(reference, ref_optimizer, x, y)
        compiled_s += middle - start
        reference_s += time.perf_counter() - middle
        loss, ref_loss = float(loss.detach()), float(ref_loss.detach())
        worst = max(worst, abs(loss - ref_loss) / max(1.0, abs(ref_loss)))
    perturbed = single_device_run(case, world, steps, perturbed=True)
    why, widening = compare_parameters(
        {k: _full(v).detach() for k, v in model.named_parameters()},
        {k: v.detach() for k, v in reference.named_parameters()},
        {k: v.detach() for k, v in perturbed.named_parameters()},
    )
    if why is None and worst > 1e-4:
        why = f"loss differs by {worst:.2e} (relative)"
    result = {"ok": why is None, "case": case.description, "compiled_s": compiled_s, "reference_s": reference_s, "widening": widening}
    return result if why is None else {**result, "why": why}


def run_fuzz(rank: int, world: int, seeds: list[int], plans: tuple[str, ...] = PLANS) -> dict:
    """Rank worker: ``{(seed, plan): result}`` for every seed under every plan; a case that raises is a
    failed result (``"why"`` holds the traceback), not an exception. ``compiled_s`` includes the
    compilation of the first step; ``reference_s`` is the single-device steps over the global batch."""
    meshes: dict = {}

    def mesh_for(plan: str):
        names = preset(plan).mesh_dim_names  # the CLI's mesh dim names for the plan
        if names not in meshes:
            shape = (world,) if len(names) == 1 else (2, world // 2)
            meshes[names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return meshes[names]

    results = {}
    for seed in seeds:
        case = random_case(seed)
        for plan in plans:
            try:
                results[(seed, plan)] = run_case(case, plan, mesh_for(plan), rank, world)
            except Exception:  # noqa: BLE001 - reported per case
                results[(seed, plan)] = {"ok": False, "why": traceback.format_exc(), "case": case.description}
    return results
