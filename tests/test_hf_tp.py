"""spmd.TensorParallel.from_huggingface: a transformers model's own TP plan as torch styles.

No process group needed; Llama's parity under this plan is in test_tp_parity.py.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import spmd_expand as spmd
import tp_cases
from spmd_expand.hf_plan import HF_STYLES, huggingface_tp_plan


@pytest.fixture(scope="module")
def llama():
    return tp_cases.build_llama()


def test_llama_plan_is_prefixed_and_mapped(llama):
    plan = spmd.TensorParallel.from_huggingface(llama).plan
    assert set(plan) == {
        "lm_head",
        "model.embed_tokens",
        *(f"model.layers.*.self_attn.{p}_proj" for p in "qkvo"),
        *(f"model.layers.*.mlp.{p}_proj" for p in ("gate", "up", "down")),
    }
    q, o, head, emb = plan["model.layers.*.self_attn.q_proj"], plan["model.layers.*.self_attn.o_proj"], plan["lm_head"], plan["model.embed_tokens"]
    assert type(q) is ColwiseParallel and q.output_layouts == (Shard(-1),)
    assert type(o) is RowwiseParallel and o.output_layouts == (Replicate(),)
    assert type(head) is ColwiseParallel and head.output_layouts == (Replicate(),)  # "colwise_gather_output"
    assert type(emb) is RowwiseParallel  # "embedding_rowwise": vocab-parallel


def test_llama_parameter_placements(llama):
    tp = spmd.TensorParallel.from_huggingface(llama)
    tp.bind(llama)
    params = dict(llama.named_parameters())
    place = lambda fqn: tp.param_placement(fqn, params[fqn])  # noqa: E731
    assert place("model.layers.0.self_attn.q_proj.weight") == Shard(0)
    assert place("model.layers.1.self_attn.o_proj.weight") == Shard(1)
    assert place("model.layers.0.mlp.down_proj.weight") == Shard(1)
    assert place("model.embed_tokens.weight") == Shard(0) and place("lm_head.weight") == Shard(0)
    assert place("model.layers.0.input_layernorm.weight") == Replicate()


def test_overrides_replace_and_drop_entries(llama):
    plan = spmd.TensorParallel.from_huggingface(
        llama, overrides={"lm_head": ColwiseParallel(output_layouts=Shard(-1)), "model.embed_tokens": None}
    ).plan
    assert plan["lm_head"].output_layouts == (Shard(-1),)
    assert "model.embed_tokens" not in plan


class _Config:
    base_model_tp_plan = {"layers.*.proj": "colwise", "layers.*.out": "rowwise", "layers.*.norm": "sequence_parallel", "layers.*.scale": "replicate", "layers.*.absent": "colwise"}


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.Module()
        layer.proj, layer.out, layer.norm = nn.Linear(4, 8), nn.Linear(8, 4), nn.LayerNorm(4)
        layer.scale = nn.Linear(4, 4)
        self.layers = nn.ModuleList([layer])


class _ForTask(nn.Module):
    """A model shaped like a transformers ``*ForCausalLM`` of an older version: no merged plan."""

    base_model_prefix = "backbone"
    _tp_plan = {"head": "colwise_rep"}

    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.backbone = _Base()
        self.head = nn.Linear(4, 10)


def test_plan_built_from_config_is_prefixed_with_the_base_model():
    plan = huggingface_tp_plan(_ForTask())
    # "replicate" needs no entry; entries naming absent modules are left out, as transformers warns.
    assert list(plan) == ["head", "backbone.layers.*.proj", "backbone.layers.*.out", "backbone.layers.*.norm"]
    assert plan["head"].output_layouts == (Replicate(),)
    assert type(plan["backbone.layers.*.norm"]) is SequenceParallel


def test_strings_without_torch_equivalent_are_refused_by_name():
    model = _ForTask()
    model.tp_plan = {"backbone.layers.*.proj": "packed_colwise", "backbone.layers.*.out": "moe_tp_experts", "head": "colwise"}
    with pytest.raises(spmd.PlanError) as info:
        spmd.TensorParallel.from_huggingface(model)
    msg = str(info.value)
    assert "'backbone.layers.*.proj': 'packed_colwise'" in msg and "'backbone.layers.*.out': 'moe_tp_experts'" in msg
    assert "'head'" not in msg
    # The fix can be pasted: every refused entry left replicated.
    assert "overrides={'backbone.layers.*.proj': None, 'backbone.layers.*.out': None} (the experts" in msg


def test_parameter_entries_are_refused():
    model = _ForTask()
    model.tp_plan = {"backbone.layers.*.proj.weight": "colwise"}
    with pytest.raises(spmd.PlanError, match="names a parameter"):
        huggingface_tp_plan(model)


def test_model_without_plan():
    with pytest.raises(spmd.PlanError, match="declares no tensor-parallel plan"):
        spmd.TensorParallel.from_huggingface(nn.Linear(2, 2))


def test_every_mapped_string_is_a_transformers_style():
    """The mapping names only strings the installed transformers registers (or 4.x's local_* twins)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    known = set(ALL_PARALLEL_STYLES.keys()) | {"local_colwise", "local_rowwise"}
    assert set(HF_STYLES) <= known, set(HF_STYLES) - known


class _CachedHeads(nn.Module):
    """Appends column-parallel features to an empty cache, as HF's DynamicCache does on its first call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        cache = torch.tensor([])  # legacy empty: torch.cat skips it
        return torch.cat([cache, self.proj(x)], dim=0)


def test_cat_onto_a_legacy_empty_tensor_under_tp(fake_mesh):
    """The projection's output is Shard(1); DTensor's cat rule would shard the 1-D empty tensor on dim 1."""
    import cases

    model = _CachedHeads()
    step = spmd.compile(mesh=fake_mesh, plan=spmd.TensorParallel({"proj": ColwiseParallel()}), lower="eager")(cases.mse_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16))
    cat = next(n for n in step.last.traced.graph_module.graph.nodes if n.target is torch.ops.aten.cat.default)
    assert cat.meta["spmd"].output.placements == (Shard(1),)
