"""torch.nn.functional losses under data parallelism: gradients equal one device's over the global batch.

Each loss's gradients are returned from the step (no optimizer), so a gradient off by the data-parallel
size cannot hide behind a scale-invariant update (Adam).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import spmd_expand as spmd

ROWS, IN, OUT = 8, 6, 4


def _targets(g: torch.Generator) -> dict:
    return {
        "real": torch.randn(ROWS, OUT, generator=g),
        "prob": torch.rand(ROWS, OUT, generator=g),
        "sign": torch.randint(0, 2, (ROWS, OUT), generator=g).float() * 2 - 1,
        "class": torch.randint(0, OUT, (ROWS,), generator=g),
        "log_prob": F.log_softmax(torch.randn(ROWS, OUT, generator=g), -1),
    }


# name -> (loss of (output, targets dict))
LOSSES = {
    "mse": lambda o, t: F.mse_loss(o, t["real"]),
    "l1": lambda o, t: F.l1_loss(o, t["real"]),
    # torch 2.13 hands a torch-function mode this call without its weight (the unweighted loss was traced).
    "l1_weighted": lambda o, t: F.l1_loss(o, t["real"], weight=t["prob"]),
    "l1_weighted_sum": lambda o, t: F.l1_loss(o, t["real"], reduction="sum", weight=t["prob"]),
    "smooth_l1": lambda o, t: F.smooth_l1_loss(o, t["real"], beta=0.5),
    "huber": lambda o, t: F.huber_loss(o, t["real"], delta=0.5),
    "bce": lambda o, t: F.binary_cross_entropy(torch.sigmoid(o), t["prob"]),
    "bce_with_logits": lambda o, t: F.binary_cross_entropy_with_logits(o, t["prob"], pos_weight=torch.full((OUT,), 2.0)),
    "soft_margin": lambda o, t: F.soft_margin_loss(o, t["sign"]),
    "kl_div_batchmean": lambda o, t: F.kl_div(F.log_softmax(o, -1), t["log_prob"], reduction="batchmean", log_target=True),
    "cross_entropy_smoothing": lambda o, t: F.cross_entropy(o, t["class"], label_smoothing=0.1),
    "poisson_nll": lambda o, t: F.poisson_nll_loss(o, t["prob"]),
    "multilabel_soft_margin": lambda o, t: F.multilabel_soft_margin_loss(o, (t["sign"] > 0).float()),
    "cosine_embedding": lambda o, t: F.cosine_embedding_loss(o, t["real"], t["sign"][:, 0]),
    "hinge_embedding": lambda o, t: F.hinge_embedding_loss(o, t["sign"]),
    "mse_sum": lambda o, t: F.mse_loss(o, t["real"], reduction="sum"),
    "margin_ranking": lambda o, t: F.margin_ranking_loss(o[:, 0], o[:, 1], t["sign"][:, 0], margin=0.1),
    "triplet_margin": lambda o, t: F.triplet_margin_loss(o, t["real"], t["prob"]),
    "multi_margin": lambda o, t: F.multi_margin_loss(o, t["class"]),
    # Each row's target classes end at its first -1 (torch 2.13's traced form counted the slots after it).
    "multilabel_margin": lambda o, t: F.multilabel_margin_loss(o, torch.where(t["sign"] > 0, t["class"][:, None].expand(-1, OUT), -1)),
    # Segmentation-shaped (N, C, H, W) logits: the mean over pixels not ignored, weighted by class, is
    # taken over the global batch (the returned loss averaged per-rank means before).
    "cross_entropy_2d_weight_ignore": lambda o, t: F.cross_entropy(
        o.view(-1, 2, 2, 1).expand(-1, 2, 2, 3),
        torch.where(t["sign"][:, :2] > 0, t["class"][:, None] % 2, -100)[:, :, None].expand(-1, 2, 3).contiguous(),
        weight=torch.tensor([1.0, 3.0]),
    ),
    "cross_entropy_2d_weight_smoothing": lambda o, t: F.cross_entropy(
        o.view(-1, 2, 2), (t["class"][:, None] % 2).expand(-1, 2).contiguous(), weight=torch.tensor([1.0, 2.0]), label_smoothing=0.2
    ),
}

# Ops across the batch dim or without a DTensor strategy, as a model or loss would use them: the same
# promise (one device's gradients), and a place for the next op that breaks it.
BATCH_OPS = {
    "var_over_batch": lambda o, t: o.var(0).sum() + o.var(),
    "std_mean": lambda o, t: sum(x.sum() for x in torch.std_mean(o, dim=0)),
    "logsumexp_over_batch": lambda o, t: torch.logsumexp(o, 0).sum(),
    "norm_over_batch": lambda o, t: o.norm(dim=0).sum() + torch.linalg.vector_norm(o),
    "normalize_over_batch": lambda o, t: (F.normalize(o, dim=0) * t["real"]).sum(),
    "softmax_over_batch": lambda o, t: (o.softmax(0) * t["real"]).sum(),
    "cumsum_over_batch": lambda o, t: (o.cumsum(0) * t["real"]).sum(),
    "max_over_batch": lambda o, t: o.amax(0).sum() + o.max(),
    "glu": lambda o, t: F.glu(o, -1).pow(2).mean(),
    "prelu": lambda o, t: F.prelu(o, torch.full((1,), 0.25)).pow(2).mean(),
    "hardswish_leaky_elu": lambda o, t: (F.hardswish(o) + F.leaky_relu(o, 0.1) + F.elu(o) + F.softplus(o)).mean(),
    "pairwise_distance": lambda o, t: F.pairwise_distance(o, t["real"]).mean(),
    "cosine_similarity": lambda o, t: F.cosine_similarity(o, t["real"]).mean(),
    "masked_fill_where": lambda o, t: o.masked_fill(t["sign"] > 0, 0.0).mean() + torch.where(t["sign"] > 0, o, 1.0).mean(),
    "rsub_floor_divide": lambda o, t: (1 - o).pow(2).mean() + (o * torch.floor_divide(t["real"], 0.5)).mean(),
    "gram_over_batch": lambda o, t: (o @ o.T).pow(2).mean(),
    "einsum_contract_batch": lambda o, t: torch.einsum("bi,bj->ij", o, t["real"]).pow(2).sum(),
    "topk_sort_median_over_batch": lambda o, t: o.topk(3, dim=0).values.sum() + (o.sort(0).values * t["real"]).sum()
    + o.median(0).values.sum(),
    "index_add_by_class": lambda o, t: torch.zeros(OUT, OUT).index_add(0, t["class"], o).pow(2).sum(),
    "layer_norm_across_batch": lambda o, t: F.layer_norm(o.T, (ROWS,)).mul(t["real"].T).sum(),
    "batch_norm_functional": lambda o, t: F.batch_norm(o, None, None, training=True).mul(t["real"]).sum(),
    "roll_diff_over_batch": lambda o, t: (o.roll(1, 0) * t["real"]).sum() + torch.diff(o, dim=0).pow(2).mean(),
    "center_over_batch": lambda o, t: (o - o.mean(0)).pow(2).mean(),
    "std_global_logcumsumexp": lambda o, t: o.std() + o.var(unbiased=False) + torch.logcumsumexp(o, 0).sum(),
    "soft_targets_weighted_nll": lambda o, t: F.cross_entropy(o, t["prob"].softmax(-1))
    + F.nll_loss(F.log_softmax(o, -1), t["class"], weight=torch.arange(1.0, OUT + 1)),
    # `for row in batch` (unbind over the split dim; it was refused): every rank computes every row.
    "iterate_rows": lambda o, t: sum((row.softmax(0) * r).sum() for row, r in zip(o, t["real"])),
    # SimCLR-style: each row's similarity to itself masked with fill_diagonal_ (ATen's as_strided).
    "fill_diagonal_similarity": lambda o, t: F.cross_entropy(
        (F.normalize(o, dim=1) @ F.normalize(o, dim=1).T).fill_diagonal_(-10.0), t["class"]
    ),
    # In-place writes to views of a split activation (autograd's backward allocates the base's
    # gradient with new_empty_strided, whose global size was not localized: a raw RuntimeError).
    "inplace_view_writes": lambda o, t: _written_views(o * 1).pow(2).sum(),
    "inplace_diagonal_of_rows": lambda o, t: _halve_diagonal(o @ o.T).pow(2).sum(),
    # An int8 count over the batch, wrapped on one device (256 elements: 0) before the cast reads it;
    # the ranks' parts (128 each: -128) cast first summed to -256, silently (scale 0 instead of 1).
    "int8_count_cast": lambda o, t: o.pow(2).mean()
    * (1 + (t["real"].repeat(8, 1) > -100).to(torch.int8).sum(dtype=torch.int8).float() / 256),
    # Antialiased resizing (a learned downsampler): ATen's _aa backward ops took the global batch size
    # (bilinear: a raw RuntimeError) or no symbolic one (bicubic: an internal assert).
    "interpolate_antialias": lambda o, t: sum(
        F.interpolate(o.view(-1, 1, 2, 2).expand(-1, 2, 2, 2) * o.view(-1, 2, 1, 2), size=size, mode=mode, antialias=True)
        .pow(2).mean()
        for mode, size in (("bilinear", (1, 3)), ("bicubic", (3, 2)))
    ),
    # torch.cdist of small inputs (_cdist_forward/_cdist_backward had no rule): to fixed prototypes,
    # within the batch (its rows split on both sides), and p=3 with a batch dim.
    "cdist": lambda o, t: torch.cdist(o, torch.linspace(-1, 1, 3 * OUT).view(3, OUT)).pow(2).mean()
    + torch.cdist(o, o).mean() + torch.cdist(o[None], t["real"][None], p=3).mean(),
}


def _written_views(h: torch.Tensor) -> torch.Tensor:
    h[:, 0] = 0
    h[:, 1:3].mul_(2)
    return h


def _halve_diagonal(h: torch.Tensor) -> torch.Tensor:
    h.diagonal().mul_(0.5)
    return h


def _step(loss_fn):
    def step(model, x, targets):
        loss = loss_fn(model(x), targets)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad()
        return loss, grads

    return step


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_losses(rank: int, world: int, plan: str, names: list[str]) -> dict:
    """Worker: per loss, (loss, grads) compiled on W ranks and on one device over the global batch."""
    import traceback

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name in names:
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
            reference = copy.deepcopy(model)
            step_fn = _step({**LOSSES, **BATCH_OPS}[name])
            step = spmd.compile(mesh=mesh, plan=spmd.FSDP() if plan == "fsdp" else spmd.DDP(), lower="eager")(step_fn)
            g = torch.Generator().manual_seed(1)
            x, targets = torch.randn(ROWS, IN, generator=g), _targets(g)
            ref_loss, ref_grads = step_fn(reference, x, targets)
            local = {k: v.chunk(world)[rank] for k, v in targets.items()}
            loss, grads = step(model, x.chunk(world)[rank], local)
            results[name] = {
                "loss": loss.detach(),
                "ref_loss": ref_loss.detach(),
                "grads": [_full(t) for t in grads],
                "ref_grads": [t.clone() for t in ref_grads],
            }
        except Exception:  # noqa: BLE001 - reported per loss by the test
            results[name] = {"error": traceback.format_exc()}
    return results
