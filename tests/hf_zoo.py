"""HuggingFace transformers models for the model-zoo parity suite.

Tiny random configs built here (no downloads): hidden 32, 2-4 heads, vocab 96, sequence 12, every
dropout probability 0, weights seeded. One layer each (one encoder and one decoder layer for BART and
T5; one stage of each width for ResNet): tracing time grows with depth, and what repeats per layer is
covered by the GPT cases of ``test_parity.py``. The step is an ordinary HF training step
(``model(input_ids=..., labels=...)``, or ``pixel_values=`` for the image classifiers ViT and ResNet,
``input_values=`` for the audio classifier wav2vec2;
``out.loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``, return ``out.loss``), trained
with AdamW at lr 1e-3.

``run_zoo`` is a worker for :func:`spmd_expand.app.launch.run_local`: on every rank it runs each
(model, plan, lowering) through :func:`cases.run_case` (the single-device reference over the global
batch and the compiled step over this rank's shard of it) and returns both for the test to compare.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import transformers

import cases

VOCAB = 96
SEQ = 12
GLOBAL_BATCH = 4
TARGET_LEN = 8  # decoder length of the encoder-decoder models
IMAGE, LABELS = 16, 5  # image classifiers: 16x16 RGB images, 5 classes

_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 key/value heads serve 4 query heads
    max_position_embeddings=32,
    attention_dropout=0.0,
)


def hf_step(*inputs: str) -> Callable:
    """The ordinary HF training step for a model called with the keywords ``inputs`` (the batch
    tensors, in that order); the model computes its own loss from ``labels``."""

    def step(model, optimizer, *batch):
        out = model(**dict(zip(inputs, batch)))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return out.loss

    return step


lm_step = hf_step("input_ids", "labels")
# With a padding ``attention_mask`` (a batch tensor, sharded like ``input_ids``).
padded_lm_step = hf_step("input_ids", "attention_mask", "labels")


def causal_batch(g: torch.Generator) -> tuple:
    """(input_ids, labels) of a causal LM; the model shifts the labels itself."""
    ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, ids.clone()


def padded_causal_batch(g: torch.Generator) -> tuple:
    """(input_ids, attention_mask, labels), right-padded: row i holds SEQ - 3i tokens.

    The ranks' shards hold different numbers of real tokens (21 and 9 of 24 for W=2), so the mean
    loss over the global batch is not the mean of the ranks' means.
    """
    ids, labels = causal_batch(g)
    lengths = torch.tensor([SEQ - 3 * i for i in range(GLOBAL_BATCH)])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return ids, mask, labels.masked_fill(mask == 0, -100)


def masked_lm_batch(g: torch.Generator) -> tuple:
    """(input_ids, labels) of a masked LM: about 30% of positions predicted, the rest -100."""
    ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    predicted = torch.rand(GLOBAL_BATCH, SEQ, generator=g) < 0.3
    return ids, torch.where(predicted, ids, torch.full_like(ids, -100))


def seq2seq_batch(g: torch.Generator) -> tuple:
    """(input_ids, labels); the model builds its decoder inputs from the labels."""
    ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, torch.randint(1, VOCAB, (GLOBAL_BATCH, TARGET_LEN), generator=g)


@dataclass(frozen=True)
class Arch:
    """One zoo entry: how to build the model, its batch and its step."""

    config: Callable[[str], transformers.PretrainedConfig]  # attn_implementation -> config
    model_class: Callable[[transformers.PretrainedConfig], torch.nn.Module]
    batch: Callable[[torch.Generator], tuple] = causal_batch
    step: Callable = lm_step
    attention: str = "sdpa"
    # Run in the worker before the model is built (e.g. registering a sharding rule with DTensor).
    setup: Optional[Callable[[], None]] = None
    # Ops the compiled local graph must hold (proof that the code path under test ran).
    expect_ops: tuple[str, ...] = ()

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.model_class(self.config(self.attention))

    def case(self) -> cases.Case:
        return cases.Case(self.build, "adamw_gpt", self.batch, self.step)


def _gpt2(attn):
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
    )


def _llama(attn):
    return transformers.LlamaConfig(**_DECODER, attn_implementation=attn)


def _mistral(attn):
    # A window shorter than the sequence: the sliding-window mask is built and used.
    return transformers.MistralConfig(**_DECODER, sliding_window=4, attn_implementation=attn)


def _mixtral(attn, experts="batched_mm"):
    return transformers.MixtralConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation=experts, attn_implementation=attn,
    )


def _qwen3(attn):
    # Per-head RMSNorm of queries and keys (q_norm / k_norm) before the rotary embedding.
    return transformers.Qwen3Config(**_DECODER, head_dim=8, attn_implementation=attn)


def _gemma2(attn):
    # Attention-logit soft-capping, alternating sliding-window layers, embeddings scaled by sqrt(hidden).
    return transformers.Gemma2Config(**_DECODER, head_dim=8, sliding_window=4, attn_implementation=attn)


def _t5(attn):
    # Relative position buckets (an integer-valued bias computed from the sequence length), tied head.
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, attn_implementation=attn,
    )


def _vit(attn):
    return transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=attn,
    )


def _resnet(attn):
    # BatchNorm after every convolution: batch statistics over the global batch, running stats updated.
    return transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=LABELS
    )


def _wav2vec2(attn):
    # A convolutional feature encoder (GroupNorm) and a weight_norm'ed positional convolution.
    return transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        num_labels=LABELS, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0, classifier_proj_size=8, attn_implementation=attn,
    )


def audio_batch(g: torch.Generator) -> tuple:
    """(input_values, labels) of an audio classifier: 400 raw samples per clip."""
    return torch.randn(GLOBAL_BATCH, 400, generator=g), torch.randint(0, LABELS, (GLOBAL_BATCH,), generator=g)


audio_step = hf_step("input_values", "labels")


def image_batch(g: torch.Generator) -> tuple:
    """(pixel_values, labels) of an image classifier."""
    return torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE, generator=g), torch.randint(0, LABELS, (GLOBAL_BATCH,), generator=g)


image_step = hf_step("pixel_values", "labels")


def _bert(attn):
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=attn,
    )


def _bart(attn):
    return transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, attn_implementation=attn,
    )


def _clip(attn):
    # A 0-d learnable temperature (logit_scale) and a contrastive loss over the whole (global) batch;
    # eos_token_id=2: the text is pooled at each row's largest token id (CLIP's original argmax).
    text = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, projection_dim=16, dropout=0.0, attention_dropout=0.0)
    vision = dict(image_size=IMAGE, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, projection_dim=16, dropout=0.0, attention_dropout=0.0)
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, attn_implementation=attn)


def _clip_model(config) -> torch.nn.Module:
    """CLIPModel with its attention key biases frozen: their exact gradient is zero (softmax ignores a
    shift shared by every key), and AdamW turns the rounding noise left in its place into steps of
    size lr, different on every run (one device's too), so those parameters cannot be compared."""
    model = transformers.CLIPModel(config)
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


def image_text_batch(g: torch.Generator) -> tuple:
    """(input_ids, pixel_values) of a contrastive image-text model: row i's caption matches row i's image."""
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, 8), generator=g), torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE, generator=g)


def image_text_step(model, optimizer, input_ids, pixel_values):
    out = model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


class LoRALinear(torch.nn.Module):
    """A low-rank adapter around a frozen linear layer (LoRA, Hu et al. 2021, as PEFT applies it):
    ``base(x) + (x A^T B^T) * alpha / r``."""

    def __init__(self, base: torch.nn.Linear, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Parameter(torch.randn(r, base.in_features) / base.in_features**0.5)
        self.lora_B = torch.nn.Parameter(torch.randn(base.out_features, r) * 0.01)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def _llama_lora_checkpointed(config) -> torch.nn.Module:
    """LoRA fine-tuning as scripts do it: the base model frozen, adapters on the query and value
    projections, HF's gradient checkpointing on (with ``enable_input_require_grads``, as PEFT does)."""
    model = transformers.LlamaForCausalLM(config)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    return model.train()


ZOO: dict[str, Arch] = {
    "gpt2": Arch(_gpt2, transformers.GPT2LMHeadModel),
    "llama": Arch(_llama, transformers.LlamaForCausalLM),
    "mistral": Arch(_mistral, transformers.MistralForCausalLM),
    "bert": Arch(_bert, transformers.BertForMaskedLM, masked_lm_batch),
    "bart": Arch(_bart, transformers.BartForConditionalGeneration, seq2seq_batch),
    "qwen3": Arch(_qwen3, transformers.Qwen3ForCausalLM),
    "gemma2": Arch(_gemma2, transformers.Gemma2ForCausalLM, attention="eager"),
    "t5": Arch(_t5, transformers.T5ForConditionalGeneration, seq2seq_batch, attention="eager"),
    "vit": Arch(_vit, transformers.ViTForImageClassification, image_batch, image_step),
    "wav2vec2": Arch(_wav2vec2, transformers.Wav2Vec2ForSequenceClassification, audio_batch, audio_step),
    "resnet": Arch(_resnet, transformers.ResNetForImageClassification, image_batch, image_step, attention="none"),
    "clip": Arch(_clip, _clip_model, image_text_batch, image_text_step),
    # Variants: eager attention, a padding mask, LoRA with gradient checkpointing, mixtures of
    # experts (batched, and grouped: transformers' custom ops, split on token rows by spmd_expand's rule).
    "gpt2_eager_attention": Arch(_gpt2, transformers.GPT2LMHeadModel, attention="eager"),
    "llama_padded": Arch(_llama, transformers.LlamaForCausalLM, padded_causal_batch, padded_lm_step),
    "llama_lora_checkpointed": Arch(_llama, _llama_lora_checkpointed),
    "mixtral": Arch(_mixtral, transformers.MixtralForCausalLM, expect_ops=("aten.bmm.default",)),
    "mixtral_grouped_mm": Arch(
        lambda attn: _mixtral(attn, "grouped_mm"),
        transformers.MixtralForCausalLM,
        expect_ops=("transformers.grouped_mm_fallback.default", "transformers.grouped_mm_fallback_backward.default"),
    ),
}


# transformers' TP plans shard a mixture of experts' experts with styles no torch style describes
# (`packed_colwise`, `moe_tp_experts`; spmd_expand refuses them): these overrides of
# ``TensorParallel.from_huggingface`` keep the experts replicated while attention and dense or
# shared-expert MLPs run tensor parallel.
EXPERTS_REPLICATED = {f"model.layers.*.mlp.experts{part}": None for part in ("", ".gate_up_proj", ".down_proj")}

def run_zoo(rank: int, world: int, runs: list[tuple[str, str, str]], steps: int = 3) -> dict:
    """Worker: ``cases.run_case`` for each (zoo name, plan name, lowering); errors are returned per run."""
    results = {}
    meshes = {}
    for name, plan, lower in runs:
        if plan not in meshes:
            meshes[plan] = cases.make_mesh(plan, world)
        start = time.process_time()
        try:
            if ZOO[name].setup is not None:
                ZOO[name].setup()
            result = cases.run_case(ZOO[name].case(), meshes[plan], rank, world, steps, lower, plan)
        except Exception:  # noqa: BLE001 - reported per run by the test
            result = {"error": traceback.format_exc()}
        # CPU seconds of this rank (wall time is inflated by other load): for sizing the suite.
        result["cpu_seconds"] = time.process_time() - start
        results[(name, plan, lower)] = result
    return results
