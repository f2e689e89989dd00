"""Train-step cases shared by the parity tests: model, optimizer, batch and step, all deterministic.

Each case runs once on one device over the global batch (the reference) and once compiled on W
ranks, each with its shard of that batch; ``run_cases`` (a worker for ``spmd_expand.app.launch.run_local``)
returns both so the test process can compare them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch._inductor.utils import run_and_get_code
from torch.distributed.tensor import DTensor

import spmd_expand as spmd
from spmd_expand.app.data import shard
from spmd_expand.plans import resolve_plan
from spmd_expand.spec import local_slice
from spmd_expand.app.models import MLP, GPTConfig, build_gpt, classification_step, language_model_step

GLOBAL_BATCH = 8


cross_entropy_step = classification_step
gpt_step = language_model_step


def mse_microbatch_step(model, optimizer, x, y=None):
    """Gradient accumulation of a mean-square loss over 2 micro-batches, traced unrolled."""
    total = 0.0
    for xs in x.chunk(2):
        loss = model(xs).pow(2).mean() / 2
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total


def microbatch_step(model, optimizer, x, y):
    """Gradient accumulation over 2 micro-batches, traced unrolled."""
    total = 0.0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        loss = F.cross_entropy(model(xs), ys) / 2
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total


def update(loss, optimizer):
    """The end of a train step: backward, optimizer step, zero_grad; returns ``loss``."""
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mse_step(model, optimizer, x, y=None):
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _staggered_adamw(params) -> torch.optim.Optimizer:
    """AdamW whose parameters have taken different numbers of steps (as after param groups were added
    at different times, or a checkpoint of such a run): per-parameter bias corrections then differ, so
    a mix-up of parameters in the optimizer's per-parameter arithmetic shows in the result."""
    params = list(params)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)
    for i, p in enumerate(params):
        optimizer.state[p] = {
            "step": torch.tensor(float(1 + 7 * i)),
            "exp_avg": torch.full_like(p, 1e-3 * (i + 1)),
            "exp_avg_sq": torch.full_like(p, 1e-6 * (i + 1)),
        }
    return optimizer


OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    # Fused SGD and Adagrad: torch 2.13 has no Meta kernel for their ops (spmd_expand.fused_optimizer_ops).
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adagrad_fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
    "adadelta_foreach": lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.01, foreach=True),
    # Rprop's update writes its states with _foreach_copy_ (a rule of spmd_expand.rules); Adamax's
    # single-tensor path (its foreach path is refused with that fix).
    "rprop_foreach": lambda ps: torch.optim.Rprop(ps, lr=1e-3, foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3, foreach=False),
    # Foreach paths with per-parameter scalar arithmetic (the horizontal_fusion pass fuses it):
    # NAdam's mu_product state and momentum schedule, Adagrad's lr decay, RMSprop's centered average.
    "nadam_foreach": lambda ps: torch.optim.NAdam(ps, lr=1e-3, decoupled_weight_decay=True, weight_decay=0.1, foreach=True),
    "adagrad_foreach": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, foreach=True),
    "rmsprop_foreach": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, foreach=True),
    "adamw_staggered": _staggered_adamw,
    # Transformers train at lr <= 1e-3; early Adam steps move each element by about lr * sign(grad),
    # so at 1e-2 rounding in near-zero gradients alone can exceed atol=1e-5.
    "adamw_gpt": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
}


# ---------------------------------------------------------------- one-op models
class LogSoftmaxModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8) * 0.1)

    def forward(self, x):
        return F.log_softmax(x @ self.w, dim=-1)


class FillPartialModel(nn.Module):
    """A sum over the batch (``Partial`` under data parallelism) filled with a constant.

    The fill replaces the partial sums: every rank's copy holds 1, and summed over W ranks the value
    would be W (DTensor's own rule for ``fill`` kept the tensor partial).
    """

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        out = self.fc(x)
        ones = out.sum(0).fill_(1.0)
        return out * ones


class BatchOrderStatistics(nn.Module):
    """Losses that rank the whole batch (OHEM's top-k, a sort weighted by ``linspace`` sized by the
    batch, a median, a cumulative sum): each row's weight depends on every other row, so no rank's
    shard alone has it (``linspace`` had no rule)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        out = self.fc(x)
        score = out.square().sum(1)
        ranked, _ = score.sort(descending=True)
        weights = torch.linspace(1.0, 0.5, score.shape[0])
        hardest = score.topk(score.shape[0] // 2).values.mean()
        extra = (ranked * weights).sum() / weights.sum() + score.median() + score.cumsum(0)[-1] / 100 + hardest
        return out + extra


class ExplicitRenorm(nn.Module):
    """``nn.Embedding(max_norm=1)`` written out: the looked-up rows of the weight parameter are rescaled
    in place before the lookup (``embedding_renorm_`` on the parameter: indices of every rank's batch)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, ids):
        with torch.no_grad():
            torch.embedding_renorm_(self.emb.weight, ids, 1.0, 2.0)
        return self.fc(self.emb(ids).mean(1))


class NllLossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return F.log_softmax(self.fc(x), dim=-1)


def nll_step(model, optimizer, x, y):
    loss = F.nll_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class EmbeddingLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.ln = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, idx):
        return self.out(self.ln(self.emb(idx)).mean(dim=1))


class FullModel(nn.Module):
    """torch.full sized by the batch: a DSymInt-sized factory."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        bias = torch.full((x.shape[0], 1), 0.5)
        return self.fc(x) + bias


class ArangeModel(nn.Module):
    """arange over the batch dim, used as values (each row scaled by its global index)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        scale = torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1) / x.shape[0]
        return self.fc(x) * (1 + scale)


class NumelModel(nn.Module):
    """sym_numel as a scalar: a hand-written mean over the whole (global) batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.sum() / h.numel()


class StrideModel(nn.Module):
    """stride(0) of the batch used as a size (the row length): must stay a local, correct value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.view(-1, h.stride(0)).sum(-1).pow(2).mean()


class StackModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return torch.stack([self.a(x), self.b(x)], dim=1).pow(2).mean()


class SliceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        return (h[:, 2:6] * h[:, :4]).mean()


class Cat100Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h * (i + 1) / 100 for i in range(100)], dim=1).pow(2).mean()


class ViewExpandModel(nn.Module):
    """A view/expand chain on the batch dim, sizes read from the batch (DSymInt)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        b = x.shape[0]
        h = self.fc(x).view(b, 2, 2)
        g = h.unsqueeze(1).expand(b, 3, 2, 2).reshape(b, 12)
        return g.pow(2).mean()


def scalar_step(model, optimizer, x):
    loss = model(x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@dataclass
class Case:
    model: Callable[[], nn.Module]
    optimizer: str
    batch: Callable[[torch.Generator], tuple]
    step: Callable
    # Tensor-parallel plan of the model ({module glob: torch TP style}) for the TP and 2-D plans.
    tp: Optional[dict] = None


def _xy(g):
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)


def _x(g):
    return (torch.randn(GLOBAL_BATCH, 16, generator=g),)


def _tokens(g):
    idx = torch.randint(0, 32, (GLOBAL_BATCH, 16), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


GPT_CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32)

MLP_TP = MLP().tensor_parallel_plan()
GPT_TP = build_gpt(GPT_CONFIG).tensor_parallel_plan()  # Megatron + vocab-parallel embedding/head

def _sequence_parallel_plan() -> dict:
    """Megatron sequence parallelism: LayerNorms sharded on the sequence dim, row-wise outputs
    reduce-scattered to it and column-wise inputs all-gathered from it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = dict(GPT_TP)
    plan.update({
        "tok_emb": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ln1": SequenceParallel(),
        "layers.*.attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ln2": SequenceParallel(),
        "layers.*.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1)),
    })
    return plan


CASES: dict[str, Case] = {
    **{f"mlp_{name}": Case(MLP, name, _xy, cross_entropy_step, MLP_TP) for name in OPTIMIZERS},
    "mlp_microbatch": Case(MLP, "adamw_foreach", _xy, microbatch_step, MLP_TP),
    # 33 and 5 rows do not divide by 2 or 4: uneven Shard(0) under FSDP.
    "mlp_uneven": Case(lambda: MLP(16, 33, 5), "adamw_foreach", lambda g: (torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)), cross_entropy_step, MLP_TP),
    "gpt_adamw": Case(lambda: build_gpt(GPT_CONFIG, seed=0), "adamw_gpt", _tokens, gpt_step, GPT_TP),
    "gpt_sequence_parallel": Case(lambda: build_gpt(GPT_CONFIG, seed=0), "adamw_gpt", _tokens, gpt_step, _sequence_parallel_plan()),
    "gpt_megatron_blocks": Case(lambda: build_gpt(GPT_CONFIG, seed=0), "adamw_gpt", _tokens, gpt_step, {k: v for k, v in GPT_TP.items() if k.startswith("layers")}),
    "log_softmax": Case(LogSoftmaxModel, "sgd", _xy, nll_step),
    "nll_loss": Case(NllLossModel, "sgd_momentum", _xy, nll_step),
    "embedding_layer_norm": Case(EmbeddingLayerNorm, "adam_foreach", lambda g: (torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)), cross_entropy_step),
    "full": Case(FullModel, "sgd", _xy, cross_entropy_step),
    "fill_partial": Case(FillPartialModel, "sgd", _xy, cross_entropy_step),
    "explicit_renorm": Case(ExplicitRenorm, "sgd", lambda g: (torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)), cross_entropy_step),
    "arange": Case(ArangeModel, "sgd", _xy, cross_entropy_step),
    "batch_order_statistics": Case(BatchOrderStatistics, "sgd", _xy, cross_entropy_step),
    "sym_numel": Case(NumelModel, "sgd", _x, scalar_step),
    "stride": Case(StrideModel, "sgd", _x, scalar_step),
    "stack": Case(StackModel, "sgd", _x, scalar_step),
    "slice": Case(SliceModel, "sgd", _x, scalar_step),
    "cat100": Case(Cat100Model, "sgd", _x, scalar_step),
    "view_expand": Case(ViewExpandModel, "sgd", _x, scalar_step),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# Plan name -> (mesh dim names for a W-rank mesh, or None for 1-D; plan factory given the case's TP plan).
PLANS: dict[str, tuple] = {
    "ddp": (None, lambda tp: spmd.DDP()),
    "fsdp": (None, lambda tp: spmd.FSDP()),
    "fsdp_keep": (None, lambda tp: spmd.FSDP(reshard_after_forward=False)),
    "tp": (None, lambda tp: spmd.TensorParallel(tp)),
    "fsdp+tp": (("dp", "tp"), lambda tp: {"dp": spmd.FSDP(), "tp": spmd.TensorParallel(tp)}),
    "ddp+tp": (("dp", "tp"), lambda tp: {"dp": spmd.DDP(), "tp": spmd.TensorParallel(tp)}),
    "hsdp": (("replicate", "shard"), lambda tp: {"replicate": spmd.DDP(), "shard": spmd.FSDP()}),
}


def make_mesh(plan: str, world: int):
    names = PLANS[plan][0]
    if names is None:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)


def inductor_kernels(code: str) -> list[str]:
    """Names of the generated kernels that Inductor's ``call`` function launches, in launch order."""
    call = code[code.index("def call("):]
    return re.findall(r"^\s+((?:cpp|triton)_\w+)[(.]", call, re.M)


def run_case(case: Case, mesh, rank: int, world: int, steps: int, lower: str, plan: str = "ddp") -> dict:
    torch.manual_seed(0)
    model = case.model()
    reference = copy.deepcopy(model)
    optimizer = OPTIMIZERS[case.optimizer](model.parameters())
    ref_optimizer = OPTIMIZERS[case.optimizer](reference.parameters())
    step = spmd.compile(mesh=mesh, plan=PLANS[plan][1](case.tp), lower=lower)(case.step)
    resolved = resolve_plan(PLANS[plan][1](case.tp), mesh, model)
    losses, ref_losses, kernels = [], [], []
    for i in range(steps):
        batch = case.batch(torch.Generator().manual_seed(100 + i))
        ref_losses.append(case.step(reference, ref_optimizer, *batch).detach())
        local = [local_slice(t, mesh, resolved.batch_placements(t)) for t in batch]
        if lower == "inductor" and not kernels and i < 2:
            # The first Inductor compilation: call 1, or call 2 when call 1 created optimizer state
            # (its graph runs once and is not sent to Inductor).
            loss, codes = run_and_get_code(step, model, optimizer, *local)
            kernels = inductor_kernels(codes[-1]) if codes else []
        else:
            loss = step(model, optimizer, *local)
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "states": {f"{k}.{s}": _full(t).clone() for k, p in model.named_parameters() for s, t in optimizer.state[p].items() if isinstance(t, torch.Tensor)},
        "ref_states": {f"{k}.{s}": t.clone() for k, p in reference.named_parameters() for s, t in ref_optimizer.state[p].items() if isinstance(t, torch.Tensor)},
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        # Ops of the last compiled local graph, e.g. to check which attention kernel or collectives ran.
        # Kernels the Inductor-generated step calls, in order (empty under lower="eager").
        "kernels": kernels,
        "graph_ops": sorted({str(n.target) for n in step.last.local_graph.graph.nodes if n.op == "call_function"}),
    }


def run_cases(rank: int, world: int, names: list[str], steps: int = 3, lower: str = "eager", plan: str = "ddp") -> dict:
    """Worker: run each named case on this rank; errors are returned per case, not raised."""
    import traceback

    mesh = make_mesh(plan, world)
    results = {}
    for name in names:
        try:
            results[name] = run_case(CASES[name], mesh, rank, world, steps, lower, plan)
        except Exception:  # noqa: BLE001 - reported per case by the test
            results[name] = {"error": traceback.format_exc()}
    return results


def accumulate_step(model, optimizer, x, y):
    """Eager-style accumulation: backward of one micro-batch, no optimizer step."""
    loss = F.cross_entropy(model(x), y) / 2
    loss.backward()
    return loss


def accumulate_and_update_step(model, optimizer, x, y):
    """The last micro-batch: backward, then the update over the accumulated gradients."""
    loss = F.cross_entropy(model(x), y) / 2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def run_no_sync(rank: int, world: int, plan: str, steps: int = 2) -> dict:
    """Worker: 2 micro-batches per step, one call each; the first under ``no_sync()``."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    optimizer = OPTIMIZERS["adamw_foreach"](model.parameters())
    ref_optimizer = OPTIMIZERS["adamw_foreach"](reference.parameters())
    accumulate = spmd.compile(mesh=mesh, plan=PLANS[plan][1](None), lower="eager")(accumulate_step)
    update = spmd.compile(mesh=mesh, plan=PLANS[plan][1](None), lower="eager")(accumulate_and_update_step)
    grads_between = []
    for i in range(steps):
        (x1, y1), (x2, y2) = (_xy(torch.Generator().manual_seed(200 + 2 * i + k)) for k in range(2))
        accumulate_step(reference, ref_optimizer, x1, y1)
        accumulate_and_update_step(reference, ref_optimizer, x2, y2)
        with accumulate.no_sync():
            accumulate(model, optimizer, shard(x1, rank, world), shard(y1, rank, world))
        grads_between.append({k: type(p.grad).__name__ + str(getattr(p.grad, "placements", "")) for k, p in model.named_parameters()})
        update(model, optimizer, shard(x2, rank, world), shard(y2, rank, world))
    from spmd_expand.graph_stats import collective_stats

    return {
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "grads_after": [p.grad is None for p in model.parameters()],
        "grads_between": grads_between,
        "accumulate_collectives": collective_stats(accumulate.last.expanded).as_dict(),  # before bucketing
        "update_collectives": collective_stats(update.last.expanded).as_dict(),
    }
