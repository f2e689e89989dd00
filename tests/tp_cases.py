"""Tensor-parallel cases beyond Colwise/Rowwise: torch's PrepareModule* styles, loss_parallel, and
HuggingFace Llama under its own TP plan. Shared by the parity tests (gloo ranks) and the graph tests
(fake process group); ``run_tp_cases`` is the worker for ``spmd_expand.app.launch.run_local``.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)

import cases
import spmd_expand as spmd
from spmd_expand.graph_stats import COLLECTIVES
from spmd_expand.spec import local_slice

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 16, 32, 4, 8


class FeedForward(nn.Module):
    """A Megatron MLP called as ``ff(x, gate=g)``; holds no parameters of its own (only its Linears),
    like torchtitan's ``attention`` / ``feed_forward`` modules that ``PrepareModuleInput`` targets."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.w2(F.gelu(self.w1(x)))
        return out if gate is None else out * gate


class Scale(nn.Module):
    """Parameter-free ``(x * 2, x.sum(-1))``: a module with a tuple output."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(-1)


class TinyLM(nn.Module):
    """Token embedding, pre-norm gated feed-forward block with a residual, norm, vocabulary head.

    ``idx`` ``(B, T)`` int64 -> logits ``(B, T, VOCAB)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.ff = FeedForward()
        self.scale = Scale()
        self.out_norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        h = self.norm(x)
        x = x + self.ff(h, gate=torch.sigmoid(h.mean(-1, keepdim=True)))
        doubled, total = self.scale(x)
        x = doubled + total.unsqueeze(-1) / DIM
        return self.head(self.out_norm(x))


def build_tiny_lm() -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyLM()


def lm_step(model, optimizer, idx, targets):
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def loss_parallel_step(model, optimizer, idx, targets):
    """The loss over vocab-sharded logits inside torch's ``loss_parallel()`` (forward and backward)."""
    logits = model(idx)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def loss_parallel_sum_step(model, optimizer, idx, targets):
    """``reduction="sum"`` over ignored targets (``-100``): the loss and the count are sums of shards."""
    logits = model(idx)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / 64
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def loss_parallel_weighted_step(model, optimizer, idx, targets):
    """Class weights and ``reduction="none"``: one loss per target, reduced by the step."""
    logits = model(idx)
    weight = 0.5 + torch.arange(VOCAB) / VOCAB
    with loss_parallel():
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=weight, reduction="none")
        loss = losses.mean()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def loss_parallel_smoothing_step(model, optimizer, idx, targets):
    """Label smoothing reads the log-probabilities twice: the fused NLL backward does not apply."""
    logits = model(idx)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    return idx, targets


def tokens_with_ignored(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx, targets = tokens(g)
    targets = targets.clone()
    targets[:, -1] = -100  # the last position has no next token
    targets[0, :3] = -100
    return idx, targets


# ---------------------------------------------------------------- plans (mesh dim "tp")
MEGATRON_FF = {"ff.w1": ColwiseParallel(), "ff.w2": RowwiseParallel()}

# torchtitan's Llama plan, in small: sequence-parallel norms, the block's input gathered from the
# sequence shards by PrepareModuleInput (positional and keyword), its output reduce-scattered back.
PREPARE_INPUT = {
    "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "ff": PrepareModuleInput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        input_kwarg_layouts={"gate": Shard(1)},
        desired_input_kwarg_layouts={"gate": Replicate()},
    ),
    "ff.w1": ColwiseParallel(),
    "ff.w2": RowwiseParallel(output_layouts=Shard(1)),
    "out_norm": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}

# The block's output stays sequence-sharded past a parameter-free module with a tuple output.
PREPARE_OUTPUT = {
    **MEGATRON_FF,
    "ff": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    "scale": PrepareModuleOutput(output_layouts=(Shard(1), Shard(1)), desired_output_layouts=(Shard(1), Replicate())),
}

PREPARE_INPUT_OUTPUT = {
    **MEGATRON_FF,
    "ff": PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Shard(1),),
        input_kwarg_layouts={"gate": Replicate()},
        desired_input_kwarg_layouts={"gate": Shard(0)},
        output_layouts=Replicate(),
        desired_output_layouts=Shard(0),
    ),
}

# Vocab-parallel head: logits stay sharded on the vocabulary for loss_parallel().
VOCAB_PARALLEL = {**MEGATRON_FF, "emb": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Shard(-1))}


# ---------------------------------------------------------------- HuggingFace Llama
def llama_config():
    from transformers import LlamaConfig

    # Grouped-query attention (2 key/value heads for 4 query heads); use_cache stays at its default
    # (True): forward builds a KV cache from an empty tensor, which the step then drops.
    return LlamaConfig(
        vocab_size=VOCAB * 2, hidden_size=DIM * 2, intermediate_size=HIDDEN * 2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ * 2,
        attention_dropout=0.0,
    )


def build_llama():
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(llama_config())


# Llama's shape settings, which every causal LM config of transformers takes under these names.
_SHAPE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "attention_dropout",
)


def build_causal_lm(config_class, model_class, **extra):
    """A causal LM of transformers with Llama's shapes (``llama_config``) and ``extra`` settings, seeded."""
    shapes = {k: v for k, v in llama_config().to_dict().items() if k in _SHAPE_KEYS}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_class(config_class(**shapes, **extra))


def build_qwen3():
    """Llama's shapes with Qwen3's per-head RMSNorm of queries and keys (``q_norm``/``k_norm``): under
    transformers' TP plan they normalize the heads of this rank's colwise ``q_proj``/``k_proj`` shards."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return build_causal_lm(Qwen3Config, Qwen3ForCausalLM, head_dim=8)


def llama_step(model, optimizer, idx, labels):
    loss = model(input_ids=idx, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def llama_loss_parallel_step(model, optimizer, idx, labels):
    """HuggingFace computes the loss inside forward; the whole step runs under ``loss_parallel()``."""
    with loss_parallel():
        loss = model(input_ids=idx, labels=labels).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def llama_tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB * 2, (BATCH, SEQ), generator=g)
    return idx, idx


@dataclass
class TPCase:
    model: Callable[[], nn.Module]
    # The TensorParallel plan of the built model (plans from the model itself need it).
    plan: Callable[[nn.Module], spmd.TensorParallel]
    step: Callable
    batch: Callable[[torch.Generator], tuple]
    optimizer: str = "adamw_gpt"


TP_CASES: dict[str, TPCase] = {
    # SGD has no state: one compilation per case.
    "prepare_input": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(PREPARE_INPUT), lm_step, tokens, "sgd"),
    "prepare_output": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(PREPARE_OUTPUT), lm_step, tokens, "sgd"),
    "prepare_input_output": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(PREPARE_INPUT_OUTPUT), lm_step, tokens, "sgd"),
    "loss_parallel": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(VOCAB_PARALLEL), loss_parallel_step, tokens_with_ignored),
    "loss_parallel_sum": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(VOCAB_PARALLEL), loss_parallel_sum_step, tokens_with_ignored, "sgd"),
    "loss_parallel_weighted": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(VOCAB_PARALLEL), loss_parallel_weighted_step, tokens_with_ignored, "sgd"),
    "loss_parallel_smoothing": TPCase(build_tiny_lm, lambda m: spmd.TensorParallel(VOCAB_PARALLEL), loss_parallel_smoothing_step, tokens, "sgd"),
    "llama": TPCase(build_llama, spmd.TensorParallel.from_huggingface, llama_step, llama_tokens),
    "qwen3": TPCase(build_qwen3, spmd.TensorParallel.from_huggingface, llama_step, llama_tokens),
    # For the 2x2 mesh: one compilation per rank instead of two (AdamW under FSDP+TP: test_parity.py).
    "llama_sgd": TPCase(build_llama, spmd.TensorParallel.from_huggingface, llama_step, llama_tokens, "sgd"),
    "llama_loss_parallel": TPCase(
        build_llama,
        lambda m: spmd.TensorParallel.from_huggingface(m, overrides={"lm_head": ColwiseParallel(output_layouts=Shard(-1))}),
        llama_loss_parallel_step,
        llama_tokens,
        "sgd",
    ),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_tp_case(case: TPCase, mesh, steps: int, lower: str) -> dict:
    """Run ``case`` compiled on ``mesh`` (1-D: TP; 2-D ``("dp", "tp")``: FSDP + TP) and on one device."""
    model = case.model()
    reference = copy.deepcopy(model)
    optimizer = cases.OPTIMIZERS[case.optimizer](model.parameters())
    ref_optimizer = cases.OPTIMIZERS[case.optimizer](reference.parameters())
    tp = case.plan(model)
    plan = tp if mesh.ndim == 1 else {"dp": spmd.FSDP(), "tp": tp}
    step = spmd.compile(mesh=mesh, plan=plan, lower=lower)(case.step)
    batch_placements = (Replicate(),) if mesh.ndim == 1 else (Shard(0), Replicate())
    losses, ref_losses = [], []
    for i in range(steps):
        batch = case.batch(torch.Generator().manual_seed(100 + i))
        ref_losses.append(case.step(reference, ref_optimizer, *batch).detach())
        local = [local_slice(t, mesh, batch_placements) for t in batch]
        losses.append(step(model, optimizer, *local).detach())
    groups = {mesh.get_group(d).group_name: d for d in range(mesh.ndim)}
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "states": {f"{k}.{s}": _full(t).clone() for k, p in model.named_parameters() for s, t in optimizer.state[p].items() if isinstance(t, torch.Tensor)},
        "ref_states": {f"{k}.{s}": t.clone() for k, p in reference.named_parameters() for s, t in ref_optimizer.state[p].items() if isinstance(t, torch.Tensor)},
        "placements": {k: tuple(v.placements) for k, v in model.named_parameters()},
        # (kind, mesh dim, output shape) of every collective of the steady-state local graph.
        "collectives": [
            (COLLECTIVES[n.target], groups[n.args[-1]], tuple(n.meta["val"].shape))
            for n in step.last.local_graph.graph.nodes
            if n.target in COLLECTIVES
        ],
        # (placements the logits have, placements the log-softmax reads them with) per log-softmax.
        "log_softmax_inputs": [
            (n.args[0].meta["spmd"].output.placements, n.meta["spmd"].inputs[0].placements)
            for n in step.last.traced.graph_module.graph.nodes
            if n.target is torch.ops.aten._log_softmax.default
        ],
    }


def run_tp_cases(rank: int, world: int, names: list[str], two_d: bool = False, steps: int = 3, lower: str = "eager") -> dict:
    """Worker: each named case on this rank (a 1-D TP mesh, or 2 x W/2 ``("dp", "tp")``); errors are
    returned per case, not raised."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")) if two_d else init_device_mesh("cpu", (world,))
    results = {}
    for name in names:
        try:
            results[name] = run_tp_case(TP_CASES[name], mesh, steps, lower)
        except Exception:  # noqa: BLE001 - reported per case by the test
            results[name] = {"error": traceback.format_exc()}
    return results
