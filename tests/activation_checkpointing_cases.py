"""Models with activation-checkpointed blocks, and the worker that trains them compiled and on one device.

``run_parity`` is the worker for ``spmd_expand.app.launch.run_local``: for each checkpointing mode it
trains a compiled copy on W ranks and a reference copy eagerly on one device over the global batch,
and returns both sets of results for the test process to compare.
"""

from __future__ import annotations

import collections
import copy
import functools
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import spmd_expand as spmd
from spmd_expand.graph_stats import collective_stats
from spmd_expand.trace import backward_index

aten = torch.ops.aten
STEPS = 2
BATCH = 8
D_IN, D_MODEL, CLASSES = 8, 16, 4


def _recompute_all_but_gelu(ctx, op, *args, **kwargs):
    """A policy function: keep GELU's outputs, recompute everything else (the matmuls too)."""
    return CheckpointPolicy.MUST_SAVE if op is aten.gelu.default else CheckpointPolicy.PREFER_RECOMPUTE


# mode -> keyword arguments of torch.utils.checkpoint.checkpoint (None: no checkpointing)
MODES = {
    "none": None,
    "full": {"use_reentrant": False},
    # the list form: save the matmuls' outputs, recompute the pointwise ops (GELU, LayerNorm)
    "selective": {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, [aten.addmm.default, aten.mm.default]),
    },
    "policy": {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, _recompute_all_but_gelu)},
    "reentrant": {"use_reentrant": True},
    # with dropout in the blocks (p=DROPOUT): its mask saved, the rest recomputed
    "dropout_saved": {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, [aten.native_dropout.default]),
    },
}
DROPOUT = 0.25
RECOMPUTABLE = (aten.gelu.default, aten.addmm.default, aten.native_layer_norm.default)


class Block(nn.Module):
    """Pre-LayerNorm MLP block with a residual: ``x + fc2(gelu(fc1(ln(x))))``; ``(B, d) -> (B, d)``."""

    def __init__(self, d: int = D_MODEL, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        return x + (F.dropout(h, self.dropout, self.training) if self.dropout else h)


class Net(nn.Module):
    """``inp`` -> checkpointed ``layers`` -> ``head``; ``(B, D_IN) -> (B, CLASSES)``."""

    def __init__(self, mode: str = "none", n_layer: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(D_IN, D_MODEL)
        self.layers = nn.ModuleList(Block(dropout=dropout) for _ in range(n_layer))
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        kwargs = MODES[self.mode]
        for block in self.layers:
            x = block(x) if kwargs is None else checkpoint(block, x, **kwargs)
        return self.head(x)


def step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(steps)]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(mode: str, plan, mesh, rank: int, world: int) -> dict:
    """Train ``Net(mode)`` compiled (this rank's rows) and eagerly on one device (all rows); also
    count the ops of this rank's local graph inside backward and its collectives."""
    torch.manual_seed(0)
    model = Net(mode, dropout=DROPOUT if mode == "dropout_saved" else 0.0)
    ref = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiled = spmd.compile(mesh=mesh, plan=plan, lower="eager")(step)
    rows = BATCH // world
    losses, ref_losses = [], []
    for i, (x, y) in enumerate(batches()):
        local = slice(rank * rows, (rank + 1) * rows)
        torch.manual_seed(i)  # both runs draw from the same generator state (dropout)
        losses.append(compiled(model, optimizer, x[local], y[local]).detach())
        torch.manual_seed(i)
        ref_losses.append(step(ref, ref_optimizer, x, y).detach())
    gm = compiled.last.local_graph
    in_backward = collections.Counter(
        str(n.target) for n in gm.graph.nodes if n.op == "call_function" and backward_index(n) is not None
    )
    # After the local passes, the recompute still runs after the forward's last matmul (the head).
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    forward_end = max(order[n] for n in gm.graph.nodes if n.target is aten.addmm.default and backward_index(n) is None)
    recomputed = [order[n] for n in gm.graph.nodes if backward_index(n) is not None and n.target in RECOMPUTABLE]
    return {
        "in_backward": dict(in_backward),
        "recompute_after_forward": all(i > forward_end for i in recomputed),
        "collectives": dict(collective_stats(gm).count),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": {k: _full(p).detach() for k, p in model.named_parameters()},
        "ref_params": dict((k, p.detach()) for k, p in ref.named_parameters()),
    }


PLANS = {"ddp": spmd.DDP, "fsdp": spmd.FSDP}


def run_parity(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """Worker: each ``(plan, mode)`` case; errors are returned per case."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for plan_name, mode in cases:
        try:
            results[plan_name, mode] = train(mode, PLANS[plan_name](), mesh, rank, world)
        except Exception:  # noqa: BLE001 - reported per case by the test
            results[plan_name, mode] = {"error": traceback.format_exc()}
    return results
