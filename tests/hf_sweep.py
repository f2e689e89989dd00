"""A wider sweep of HuggingFace models than the suite runs, by hand (not collected by pytest).

Each model is a tiny random config (no downloads) trained 2 AdamW steps compiled on 2 gloo ranks and on
one device over the global batch, compared like ``test_hf_zoo.py`` (losses, parameters, optimizer
states; rtol=1e-4, atol=1e-5). Run it after a torch or transformers upgrade; the README lists what it
last covered. ``--plans hsdp`` runs on 4 ranks (a 2x2 mesh: replicated over one dim, sharded over the
other; the other plans then run on 4 ranks too). ``--tp`` runs the causal LMs under tensor parallelism
from each model's own TP plan.

    python tests/hf_sweep.py --plans ddp fsdp
    python tests/hf_sweep.py --plans hsdp --models qwen2_moe deepseek_v3
    python tests/hf_sweep.py --tp --models qwen2 gemma
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_zoo  # noqa: E402
from hf_zoo import EXPERTS_REPLICATED, IMAGE, LABELS, VOCAB, Arch, _DECODER, audio_batch, audio_step, image_batch, image_step, masked_lm_batch, seq2seq_batch  # noqa: E402
from spmd_expand.app.launch import run_local  # noqa: E402


def _config(cls, **kw):
    return lambda attn: cls(**kw, attn_implementation=attn)


def _plain_config(cls, **kw):
    """A config class that takes no ``attn_implementation`` (``attention="none"`` entries)."""
    return lambda attn: cls(**kw)


_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)
_BERT_LIKE = dict(
    **_SMALL, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
_SEQ2SEQ = dict(
    vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0,
)
SWEEP = {
    "qwen2": Arch(_config(transformers.Qwen2Config, **_DECODER), transformers.Qwen2ForCausalLM),
    "phi3": Arch(_config(transformers.Phi3Config, **_DECODER, pad_token_id=0), transformers.Phi3ForCausalLM),
    "gemma": Arch(_config(transformers.GemmaConfig, **_DECODER, head_dim=8), transformers.GemmaForCausalLM),
    "starcoder2": Arch(_config(transformers.Starcoder2Config, **_DECODER, residual_dropout=0.0, embedding_dropout=0.0), transformers.Starcoder2ForCausalLM),
    "stablelm": Arch(_config(transformers.StableLmConfig, **_DECODER), transformers.StableLmForCausalLM),
    "gpt_neox": Arch(_config(transformers.GPTNeoXConfig, **_SMALL, intermediate_size=64, num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0), transformers.GPTNeoXForCausalLM),
    "opt": Arch(_config(transformers.OPTConfig, **_SMALL, ffn_dim=64, num_attention_heads=4, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=32), transformers.OPTForCausalLM),
    "falcon": Arch(_config(transformers.FalconConfig, **_SMALL, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0), transformers.FalconForCausalLM),
    "bloom": Arch(_config(transformers.BloomConfig, vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4, hidden_dropout=0.0, attention_dropout=0.0), transformers.BloomForCausalLM, attention="eager"),
    "gptj": Arch(_config(transformers.GPTJConfig, vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), transformers.GPTJForCausalLM, attention="eager"),
    "roberta": Arch(_config(transformers.RobertaConfig, **{**_BERT_LIKE, "max_position_embeddings": 40}), transformers.RobertaForMaskedLM, masked_lm_batch),
    "distilbert": Arch(_config(transformers.DistilBertConfig, vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0), transformers.DistilBertForMaskedLM, masked_lm_batch),
    "albert": Arch(_config(transformers.AlbertConfig, **_BERT_LIKE, embedding_size=16, classifier_dropout_prob=0.0), transformers.AlbertForMaskedLM, masked_lm_batch, attention="eager"),
    "electra": Arch(_config(transformers.ElectraConfig, **_BERT_LIKE, embedding_size=16), transformers.ElectraForMaskedLM, masked_lm_batch),
    "deberta_v2": Arch(_plain_config(transformers.DebertaV2Config, **_BERT_LIKE), transformers.DebertaV2ForMaskedLM, masked_lm_batch, attention="none"),
    "mpnet": Arch(_plain_config(transformers.MPNetConfig, **{**_BERT_LIKE, "max_position_embeddings": 40}), transformers.MPNetForMaskedLM, masked_lm_batch, attention="none"),
    "mobilebert": Arch(_plain_config(transformers.MobileBertConfig, **_BERT_LIKE, embedding_size=16, intra_bottleneck_size=16, num_feedforward_networks=1, true_hidden_size=16), transformers.MobileBertForMaskedLM, masked_lm_batch, attention="none"),
    "gpt_bigcode": Arch(_config(transformers.GPTBigCodeConfig, vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, multi_query=True), transformers.GPTBigCodeForCausalLM),
    "codegen": Arch(_config(transformers.CodeGenConfig, vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), transformers.CodeGenForCausalLM, attention="eager"),
    "phi": Arch(_config(transformers.PhiConfig, **_DECODER, resid_pdrop=0.0, embd_pdrop=0.0), transformers.PhiForCausalLM),
    "olmo": Arch(_config(transformers.OlmoConfig, **_DECODER), transformers.OlmoForCausalLM),
    "cohere": Arch(_config(transformers.CohereConfig, **_DECODER), transformers.CohereForCausalLM),
    "llama_tied": Arch(_config(transformers.LlamaConfig, **_DECODER, tie_word_embeddings=True), transformers.LlamaForCausalLM),
    "biogpt": Arch(_config(transformers.BioGptConfig, **_BERT_LIKE), transformers.BioGptForCausalLM),
    "mamba": Arch(_plain_config(transformers.MambaConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, state_size=4, expand=2, conv_kernel=4), transformers.MambaForCausalLM, attention="none"),
    "pegasus": Arch(_config(transformers.PegasusConfig, **_SEQ2SEQ, decoder_start_token_id=0, pad_token_id=0), transformers.PegasusForConditionalGeneration, seq2seq_batch),
    "mbart": Arch(_config(transformers.MBartConfig, **_SEQ2SEQ, pad_token_id=1), transformers.MBartForConditionalGeneration, seq2seq_batch),
    "convnext": Arch(_plain_config(transformers.ConvNextConfig, num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=LABELS, drop_path_rate=0.0, patch_size=2), transformers.ConvNextForImageClassification, image_batch, image_step, attention="none"),
    # Pools its tokens with AdaptiveAvgPool1d(1) on a transposed (channels-last) input.
    "swin": Arch(_plain_config(transformers.SwinConfig, image_size=IMAGE, num_labels=LABELS, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0), transformers.SwinForImageClassification, image_batch, image_step, attention="none"),
    "beit": Arch(_config(transformers.BeitConfig, image_size=IMAGE, num_labels=LABELS, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0, use_relative_position_bias=True), transformers.BeitForImageClassification, image_batch, image_step),
    "regnet": Arch(_plain_config(transformers.RegNetConfig, num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4, num_labels=LABELS), transformers.RegNetForImageClassification, image_batch, image_step, attention="none"),
    "segformer": Arch(_plain_config(transformers.SegformerConfig, num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0, classifier_dropout_prob=0.0), transformers.SegformerForImageClassification, image_batch, image_step, attention="none"),
    "fnet": Arch(_plain_config(transformers.FNetConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0, use_tpu_fourier_optimizations=False), transformers.FNetForMaskedLM, masked_lm_batch, attention="none"),
    "xlm_roberta": Arch(_config(transformers.XLMRobertaConfig, **{**_BERT_LIKE, "max_position_embeddings": 40}), transformers.XLMRobertaForMaskedLM, masked_lm_batch),
    "squeezebert": Arch(_plain_config(transformers.SqueezeBertConfig, **_BERT_LIKE, embedding_size=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2, output_groups=2), transformers.SqueezeBertForMaskedLM, masked_lm_batch, attention="none"),
    "convbert": Arch(_plain_config(transformers.ConvBertConfig, **_BERT_LIKE, embedding_size=32, head_ratio=2, conv_kernel_size=3), transformers.ConvBertForMaskedLM, masked_lm_batch, attention="none"),
    "xlnet": Arch(_plain_config(transformers.XLNetConfig, vocab_size=VOCAB, d_model=32, n_layer=1, n_head=2, d_inner=64, dropout=0.0), transformers.XLNetLMHeadModel, attention="none"),
    "ctrl": Arch(_plain_config(transformers.CTRLConfig, vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, dff=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0), transformers.CTRLLMHeadModel, attention="none"),
    "marian": Arch(_config(transformers.MarianConfig, **_SEQ2SEQ, decoder_start_token_id=0, pad_token_id=0), transformers.MarianMTModel, seq2seq_batch),
    "blenderbot": Arch(_config(transformers.BlenderbotSmallConfig, **_SEQ2SEQ, decoder_start_token_id=0, pad_token_id=0), transformers.BlenderbotSmallForConditionalGeneration, seq2seq_batch),
    "mt5": Arch(_plain_config(transformers.MT5Config, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0), transformers.MT5ForConditionalGeneration, seq2seq_batch, attention="none"),
    "poolformer": Arch(_plain_config(transformers.PoolFormerConfig, num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[3, 3], strides=[2, 2], padding=[1, 1], num_labels=LABELS, drop_path_rate=0.0), transformers.PoolFormerForImageClassification, image_batch, image_step, attention="none"),
    "hubert": Arch(_plain_config(transformers.HubertConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, num_labels=LABELS, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=16), transformers.HubertForSequenceClassification, audio_batch, audio_step, attention="none"),
    "gemma3_text": Arch(_config(transformers.Gemma3TextConfig, **_DECODER, head_dim=8, sliding_window=4), transformers.Gemma3ForCausalLM),
    "nemotron": Arch(_config(transformers.NemotronConfig, **_DECODER), transformers.NemotronForCausalLM),
    "glm": Arch(_config(transformers.GlmConfig, **_DECODER, head_dim=8, pad_token_id=0), transformers.GlmForCausalLM),
    "helium": Arch(_config(transformers.HeliumConfig, **_DECODER, head_dim=8), transformers.HeliumForCausalLM),
    "modernbert": Arch(_config(transformers.ModernBertConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32, pad_token_id=0, global_attn_every_n_layers=1), transformers.ModernBertForMaskedLM, masked_lm_batch),
    # Mixtures of experts on transformers' grouped_mm experts (their default on CPU): custom ops that
    # spmd_expand's rule splits on token rows.
    "qwen2_moe": Arch(_config(transformers.Qwen2MoeConfig, **_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16), transformers.Qwen2MoeForCausalLM),
    "olmoe": Arch(_config(transformers.OlmoeConfig, **_DECODER, num_experts=4, num_experts_per_tok=2), transformers.OlmoeForCausalLM),
    # Multi-head latent attention (low-rank q and kv with a decoupled rotary part) and a shared expert.
    "deepseek_v3": Arch(_config(transformers.DeepseekV3Config, **_DECODER, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1), transformers.DeepseekV3ForCausalLM),
    "qwen3_moe": Arch(_config(transformers.Qwen3MoeConfig, **_DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), transformers.Qwen3MoeForCausalLM),
    "granitemoe": Arch(_config(transformers.GraniteMoeConfig, **_DECODER, num_local_experts=4, num_experts_per_tok=2), transformers.GraniteMoeForCausalLM),
}
# Causal LMs whose config carries a base-model TP plan: (config class, model class, config settings,
# optional plan overrides).
TP_MODELS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 8}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 4}),
    "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM, {"residual_dropout": 0.0, "embedding_dropout": 0.0}),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, {}),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {"head_dim": 8, "sliding_window": 4}),
    "nemotron": (transformers.NemotronConfig, transformers.NemotronForCausalLM, {}),
    # Without its q/k/v biases here: the key bias's gradient is zero up to rounding (softmax ignores a
    # shift shared by every key) and Adam amplified that rounding past the tolerance (1.1e-5 after 2
    # steps under TP; everything else agreed). Qwen2 covers q/k/v biases under TP.
    "glm": (transformers.GlmConfig, transformers.GlmForCausalLM, {"head_dim": 8, "pad_token_id": 0, "attention_bias": False}),
    "helium": (transformers.HeliumConfig, transformers.HeliumForCausalLM, {"head_dim": 8}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}, EXPERTS_REPLICATED),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}, EXPERTS_REPLICATED,
    ),
    # Its plan covers the MLPs only (multi-head latent attention stays replicated): the shared
    # experts run tensor parallel.
    "deepseek_v3": (
        transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 0,
         "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "n_group": 1, "topk_group": 1},
        EXPERTS_REPLICATED,
    ),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2}, EXPERTS_REPLICATED),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8}, EXPERTS_REPLICATED,
    ),
}


def _zoo_worker(rank: int, world: int, runs: list) -> dict:
    hf_zoo.ZOO.update(SWEEP)
    return hf_zoo.run_zoo(rank, world, runs, 2)


def _tp_worker(rank: int, world: int, names: list, two_d: bool) -> dict:
    import spmd_expand as spmd
    import tp_cases

    for name in names:
        config_class, model_class, extra, *overrides = TP_MODELS[name]
        build = functools.partial(tp_cases.build_causal_lm, config_class, model_class, **extra)
        plan = functools.partial(spmd.TensorParallel.from_huggingface, overrides=overrides[0] if overrides else None)
        tp_cases.TP_CASES[name] = tp_cases.TPCase(build, plan, tp_cases.llama_step, tp_cases.llama_tokens)
    return tp_cases.run_tp_cases(rank, world, names, two_d, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp", "hsdp"])
    parser.add_argument("--models", nargs="+", help="default: every model of the sweep")
    parser.add_argument("--tp", action="store_true", help="tensor parallel from the models' own plans")
    parser.add_argument("--two-d", action="store_true", help="with --tp: FSDP x TP on a 2x2 mesh (4 ranks)")
    args = parser.parse_args()
    failed = 0
    if args.tp:
        from test_tp_parity import check

        names = args.models or list(TP_MODELS)
        per_rank = run_local(_tp_worker, 4 if args.two_d else 2, names, args.two_d, timeout_s=1800)
        runs = [(name, name) for name in names]
    else:
        from test_parity import check

        runs = [((n, plan, "eager"), (n, plan, "eager")) for plan in args.plans for n in (args.models or list(SWEEP))]
        world = 4 if "hsdp" in args.plans else 2
        per_rank = run_local(_zoo_worker, world, [r for r, _ in runs], timeout_s=1800)
    for key, label in runs:
        try:
            check(per_rank, key)
            print(f"ok    {label}", flush=True)
        except AssertionError as e:
            failed += 1
            print(f"FAIL  {label}: {str(e).strip().splitlines()[-1]}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
