"""Workers for tests/test_lowering.py's multi-rank cases (spawned processes import them from here)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import spmd_expand as spmd


def batch_weighted_step(model, optimizer, x):
    """A loss of terms over the whole batch (factory tensors sized by it, the rows' Gram matrix): its
    backward all-gathers several values. From the hunt on cross-sample losses, where Inductor's code
    for the graph after the prologue read one all-gather's output before its wait (torch 2.13, CPU)."""
    o = model(x)
    n = x.shape[0]
    loss = (
        (o[1:, 0] * torch.ones(n - 1).cumsum(0)).sum()
        + (o[: n // 2, 1] * torch.arange(n // 2)).sum()
        + (torch.cat([o[:, 0], o[:1, 0]]) * torch.arange(n + 1)).sum()
        + (torch.zeros(n, n) + o @ o.T).triu().sum()
        + (o[:, 0] * torch.full((n,), 1.0 / n)).sum()
        + (o[:, 1] * torch.linspace(0, 1, n)).sum()
        + (torch.cat([o[:, 2], o[:, 3]]) * torch.arange(2 * n)).sum()
        + (o[:, 0] * torch.arange(n, 0, -1)).sum()
        + (o[::2, 0] * torch.arange(0, n, 2)).sum()
        + (o[:, 0] * torch.arange(1, n + 1)).sum()
        + (o @ o.T)[torch.tril_indices(n, n, -1)[0], torch.tril_indices(n, n, -1)[1]].pow(2).sum()
        + ((o @ o.T) * (1 - torch.eye(n))).sum()
    ) * 1e-3
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def run_batch_weighted_inductor(rank: int, world: int) -> dict:
    """Worker: :func:`batch_weighted_step` under DDP lowered by Inductor, and on one device over the
    global batch; losses, parameters, and the warnings of the compiled calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = spmd.compile(mesh=init_device_mesh("cpu", (world,)), plan=spmd.DDP(), lower="inductor")(batch_weighted_step)
    losses, ref_losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 + i))
            rows = x.shape[0] // world
            losses.append(step(model, optimizer, x[rank * rows:(rank + 1) * rows]).detach())
            ref_losses.append(batch_weighted_step(reference, ref_optimizer, x).detach())
    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
    return {
        "losses": losses, "ref_losses": ref_losses, "params": params,
        "ref_params": [p.detach() for p in reference.parameters()],
        "warnings": [str(w.message) for w in caught],
    }


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _padded_tokens(call: int, batch: int = 4, length: int = 12):
    """Token ids, labels (-100 after each sample's end) and the attention mask (0 there)."""
    g = torch.Generator().manual_seed(100 + call)
    ids = torch.randint(0, 64, (batch, length), generator=g)
    labels, mask = ids.clone(), torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        end = 3 + call if b < batch // 2 else length - 1 - b % 2
        labels[b, end:], mask[b, end:] = -100, 0
    return ids, labels, mask


def padded_llama_step(model, optimizer, ids, labels, mask):
    count = (labels[:, 1:] != -100).sum()  # HF's num_items_in_batch: the global count of targets
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def run_padded_llama_fsdp_inductor(rank: int, world: int) -> dict:
    """Worker: a HuggingFace Llama with a padded batch, FSDP, Inductor, and on one device over the
    global batch; losses, parameters, and the lowering's log lines (spmd_expand.lower)."""
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    logger = logging.getLogger("spmd_expand.lower")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = spmd.compile(mesh=init_device_mesh("cpu", (world,)), plan=spmd.FSDP(), lower="inductor")(padded_llama_step)
    losses, ref_losses = [], []
    for call in range(3):
        batch = _padded_tokens(call)
        losses.append(step(model, optimizer, *(t.chunk(world)[rank] for t in batch)).detach())
        ref_losses.append(padded_llama_step(reference, ref_optimizer, *batch).detach())
    logger.removeHandler(lines)
    return {
        "losses": losses, "ref_losses": ref_losses, "lowering": step.last.lowering, "log": lines.lines,
        "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
        "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
    }
