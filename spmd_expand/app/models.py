"""Reference models for tests, benchmarks and ``spmd-expand train``.

Both models are deterministic by default (``GPTConfig.dropout=0``); with dropout on, the
distributed step still equals the single-device one when every rank is seeded alike (see
:mod:`spmd_expand.rng`). Module attribute names are part of the interface:
tensor-parallel plans address submodules by fully qualified name globs such as
``layers.*.attn.q_proj`` or ``layers.*.mlp.fc1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

__all__ = ["MLP", "GPTConfig", "CausalSelfAttention", "Block", "GPT", "SAVED_BY_SELECTIVE", "build_gpt"]

_aten = torch.ops.aten
SAVED_BY_SELECTIVE = (
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
)
"""Ops whose outputs ``activation_checkpointing="selective"`` saves (torchtitan's choice, in small:
matmuls and attention are costly to recompute, pointwise ops are cheap)."""


class MLP(nn.Module):
    """Two-layer perceptron: ``fc1`` -> activation -> ``fc2``.

    Input ``(*, in_features)``, output ``(*, out_features)``.
    """

    def __init__(
        self,
        in_features: int = 16,
        hidden: int = 32,
        out_features: int = 4,
        *,
        activation: Callable[[], nn.Module] = nn.ReLU,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = activation()
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def tensor_parallel_plan(self) -> dict:
        """Megatron's MLP: ``fc1`` column-wise, ``fc2`` row-wise (for :class:`spmd_expand.TensorParallel`)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`.

    Attributes:
        vocab_size: number of token ids; inputs must lie in ``[0, vocab_size)``.
        block_size: maximum sequence length (size of the position table).
        n_layer: number of transformer blocks.
        n_head: number of attention heads; must divide ``n_embd``.
        n_embd: model width.
        dropout: drop probability of the attention weights (SDPA's ``dropout_p``) and of each
            block's two residual branches, in training mode; 0 traces no dropout at all.
        activation_checkpointing: ``"none"``; ``"full"``: each block runs under
            ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (backward recomputes it);
            ``"selective"``: the same with :data:`SAVED_BY_SELECTIVE` saved (matmuls, attention),
            the rest (LayerNorm, GELU, residual adds) recomputed. With ``dropout > 0`` a checkpointed
            block's dropout would be drawn again in backward, which ``spmd.compile`` refuses.
    """

    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"activation_checkpointing must be 'none', 'full' or 'selective', not {self.activation_checkpointing!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/out projections.

    Input and output ``(B, T, n_embd)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        # No key bias: its gradient is identically zero (softmax ignores a per-query shift of the
        # scores), so Adam would turn rounding noise in it into full-size updates.
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The head count is inferred (-1), not taken from the config: with column-parallel
        # q/k/v projections each rank only holds n_head / tp_degree heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)  # (B, heads, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.out_proj(y)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Input and output ``(B, T, n_embd)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config.n_embd, 4 * config.n_embd, config.n_embd, activation=nn.GELU)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._residual_dropout(self.attn(self.ln1(x)))
        return x + self._residual_dropout(self.mlp(self.ln2(x)))

    def _residual_dropout(self, h: torch.Tensor) -> torch.Tensor:
        # Skipped entirely at p=0: F.dropout(p=0) would still trace a copy into the graph.
        return F.dropout(h, self.dropout, self.training) if self.dropout else h


class GPT(nn.Module):
    """Character-level GPT-2-style decoder with a head tied to the token embedding.

    ``head.weight`` and ``tok_emb.weight`` are the same :class:`~torch.nn.Parameter`, so
    ``named_parameters()`` lists it once, as ``tok_emb.weight``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder.

        Args:
            idx: token ids, int64 ``(B, T)`` with ``T <= config.block_size``.
            targets: next-token ids, int64 ``(B, T)``, or ``None``.

        Returns:
            Logits ``(B, T, vocab_size)`` when ``targets`` is ``None``, otherwise the scalar
            mean cross-entropy loss over all ``B * T`` positions.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.layers:
            x = self._run_block(block, x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.view(-1))

    def _run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mode = self.config.activation_checkpointing
        if mode == "none":
            return block(x)
        context_fn = (
            functools.partial(create_selective_checkpoint_contexts, list(SAVED_BY_SELECTIVE))
            if mode == "selective"
            else noop_context_fn
        )
        return checkpoint(block, x, use_reentrant=False, context_fn=context_fn)

    def tensor_parallel_plan(self, vocab_parallel: bool = True) -> dict:
        """Megatron-LM's plan (for :class:`spmd_expand.TensorParallel`): q/k/v and fc1 column-wise,
        out-proj and fc2 row-wise; with ``vocab_parallel`` also a row-wise (vocab-sharded) token
        embedding and the tied head column-wise, both ``Shard(0)`` over the vocabulary."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {
            "layers.*.attn.q_proj": ColwiseParallel(),
            "layers.*.attn.k_proj": ColwiseParallel(),
            "layers.*.attn.v_proj": ColwiseParallel(),
            "layers.*.attn.out_proj": RowwiseParallel(),
            "layers.*.mlp.fc1": ColwiseParallel(),
            "layers.*.mlp.fc2": RowwiseParallel(),
        }
        if vocab_parallel:
            plan.update({"tok_emb": RowwiseParallel(), "head": ColwiseParallel()})
        return plan

def build_gpt(config: GPTConfig | None = None, seed: int = 0) -> GPT:
    """Build a :class:`GPT` whose initial weights depend only on ``config`` and ``seed``.

    The caller's global RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config if config is not None else GPTConfig())


def classification_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An ordinary single-device train step: cross-entropy of ``model(x)`` (B, C) against ``y`` (B,),
    backward, optimizer step, zero_grad. Returns the scalar loss."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def language_model_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """An ordinary single-device train step for :class:`GPT`: ``model(idx, targets)`` (B, T) ids ->
    mean next-token loss, backward, optimizer step, zero_grad. Returns the scalar loss."""
    loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss
