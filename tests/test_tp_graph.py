"""Tensor parallel's expanded graph on the fake process group: Megatron's communication, no more.

Megatron-LM (Shoeybi et al. 2019): with q/k/v and fc1 column-wise and out-proj and fc2 row-wise, each
transformer block all-reduces once after attention and once after the MLP in forward, and once for
each in backward (the gradient of the block input); no weight is ever gathered.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

import cases
import spmd_expand as spmd
from spmd_expand.app.models import build_gpt
from spmd_expand.trace import backward_index

C10D = torch.ops._c10d_functional
LAYERS = cases.GPT_CONFIG.n_layer


def compile_gpt(mesh, tp_plan):
    model = build_gpt(cases.GPT_CONFIG, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd.compile(mesh=mesh, plan=spmd.TensorParallel(tp_plan), lower="eager", passes=[])(cases.gpt_step)
    idx = torch.randint(0, cases.GPT_CONFIG.vocab_size, (2, cases.GPT_CONFIG.block_size))
    for _ in range(2):
        step(model, optimizer, idx, idx)
    return step, model


def collectives(step, target):
    nodes = [n for n in step.last.local_graph.graph.nodes if n.target is target]
    forward = [n for n in nodes if backward_index(n) is None]
    backward = [n for n in nodes if backward_index(n) is not None]
    return forward, backward


def test_megatron_blocks_all_reduce_once_per_block(fake_mesh):
    blocks = {k: v for k, v in cases.GPT_TP.items() if k.startswith("layers")}
    step, model = compile_gpt(fake_mesh, blocks)
    forward, backward = collectives(step, C10D.all_reduce.default)
    activation = (2, cases.GPT_CONFIG.block_size, cases.GPT_CONFIG.n_embd)
    # Forward: one per attention block and one per MLP block, each of a full activation.
    assert [tuple(n.meta["val"].shape) for n in forward] == [activation] * (2 * LAYERS)
    # Backward: the matching ones (gradient of each block's input), nothing else.
    assert [tuple(n.meta["val"].shape) for n in backward] == [activation] * (2 * LAYERS)
    gathered = [n for n in step.last.local_graph.graph.nodes if n.target is C10D.all_gather_into_tensor.default]
    assert gathered == []
    assert [n for n in step.last.local_graph.graph.nodes if n.target is C10D.reduce_scatter_tensor.default] == []


def test_megatron_parameter_placements(fake_mesh):
    blocks = {k: v for k, v in cases.GPT_TP.items() if k.startswith("layers")}
    _, model = compile_gpt(fake_mesh, blocks)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert attn.q_proj.weight.placements == (Shard(0),) and attn.q_proj.bias.placements == (Shard(0),)
    assert attn.out_proj.weight.placements == (Shard(1),) and attn.out_proj.bias.placements == (Replicate(),)
    assert mlp.fc1.weight.placements == (Shard(0),) and mlp.fc2.weight.placements == (Shard(1),)
    assert model.ln_f.weight.placements == (Replicate(),)


def test_heads_per_rank_come_from_sharded_sizes(fake_mesh):
    """The model reshapes with view(B, T, -1, head_dim): the local head count is 4 / W."""
    blocks = {k: v for k, v in cases.GPT_TP.items() if k.startswith("layers")}
    step, _ = compile_gpt(fake_mesh, blocks)
    world = fake_mesh.size()
    heads = cases.GPT_CONFIG.n_head
    head_dim = cases.GPT_CONFIG.n_embd // heads
    views = [
        n for n in step.last.local_graph.graph.nodes
        if n.target is torch.ops.aten.view.default and len(n.args[1]) == 4 and n.args[1][-1] == head_dim
    ]
    assert views, "no head-splitting view in the local graph"
    assert all(n.args[1][2] == heads // world for n in views), [n.args[1] for n in views]


def test_vocab_parallel_embedding_and_head_gather_no_weight(fake_mesh):
    """Row-wise embedding and column-wise head (tied, both Shard(0) over the vocabulary)."""
    step, model = compile_gpt(fake_mesh, cases.GPT_TP)
    assert model.tok_emb.weight.placements == (Shard(0),) and model.head.weight is model.tok_emb.weight
    forward, backward = collectives(step, C10D.all_reduce.default)
    activation = (2, cases.GPT_CONFIG.block_size, cases.GPT_CONFIG.n_embd)
    # The embedding's masked partial lookup is summed once, then Megatron's two per block.
    assert [tuple(n.meta["val"].shape) for n in forward] == [activation] * (1 + 2 * LAYERS)
    gathers = [n for n in step.last.local_graph.graph.nodes if n.target is C10D.all_gather_into_tensor.default]
    # Only the vocab-sharded logits are gathered before the loss; never a weight.
    assert len(gathers) == 1
    source = gathers[0].args[0]
    while source.op == "call_function" and len(source.all_input_nodes) == 1:
        source = source.all_input_nodes[0]
    assert source.op != "placeholder", "a parameter is all-gathered"
    assert gathers[0].meta["val"].numel() == 2 * cases.GPT_CONFIG.block_size * cases.GPT_CONFIG.vocab_size
