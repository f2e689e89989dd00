"""loss_parallel(): the cross-entropy over vocab-sharded logits never gathers them (fake 4-rank mesh).

Parity on real ranks is in test_tp_parity.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

import spmd_expand as spmd
import tp_cases
from spmd_expand.loss_parallel import LOSS_PARALLEL_KEY
from spmd_expand.trace import backward_index

C10D = torch.ops._c10d_functional
aten = torch.ops.aten
ROWS = tp_cases.BATCH * tp_cases.SEQ


def compile_tiny_lm(mesh, step):
    model = tp_cases.build_tiny_lm()
    compiled = spmd.compile(mesh=mesh, plan=spmd.TensorParallel(tp_cases.VOCAB_PARALLEL), lower="eager")(step)
    compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *tp_cases.tokens_with_ignored(torch.Generator().manual_seed(0)))
    return compiled


def shapes(compiled, target, backward=None):
    return [
        tuple(n.meta["val"].shape)
        for n in compiled.last.local_graph.graph.nodes
        if n.target is target and (backward is None or (backward_index(n) is not None) == backward)
    ]


def test_logits_are_gathered_without_loss_parallel(fake_mesh):
    """The baseline the next test improves on: DTensor's log-softmax rule gathers the logits."""
    compiled = compile_tiny_lm(fake_mesh, tp_cases.lm_step)
    gathered = shapes(compiled, C10D.all_gather_into_tensor.default)
    # (all_gather_into_tensor stacks the shards on dim 0; the elements are the full logits)
    assert [torch.Size(s).numel() for s in gathered] == [ROWS * tp_cases.VOCAB]


def test_loss_parallel_gathers_no_logits(fake_mesh):
    compiled = compile_tiny_lm(fake_mesh, tp_cases.loss_parallel_step)
    assert shapes(compiled, C10D.all_gather_into_tensor.default) == []
    # Forward: the embedding's and the block's activations, then the log-softmax's max and sum of
    # exponentials and the NLL's picked log-probabilities, one value per row each.
    activation = (tp_cases.BATCH, tp_cases.SEQ, tp_cases.DIM)
    forward = shapes(compiled, C10D.all_reduce.default, backward=False)
    assert sorted(forward) == sorted([activation] * 2 + [(ROWS, 1)] * 3), forward
    # Backward: the fused NLL + log-softmax gradient is local; only the block's input gradient and
    # the embedding's, no logits-sized tensor.
    backward = shapes(compiled, C10D.all_reduce.default, backward=True)
    assert all(s == activation for s in backward), backward
    assert all(tp_cases.VOCAB not in s[-1:] for s in shapes(compiled, C10D.reduce_scatter_tensor.default))


def test_nodes_inside_the_context_are_tagged_and_placed(fake_mesh):
    compiled = compile_tiny_lm(fake_mesh, tp_cases.loss_parallel_step)
    graph = compiled.last.traced.graph_module.graph
    tagged = {n.target for n in graph.nodes if (n.meta.get("custom") or {}).get(LOSS_PARALLEL_KEY)}
    assert {aten._log_softmax.default, aten.nll_loss_forward.default, aten.nll_loss_backward.default} <= tagged
    # The model's forward ran before the context: its matmuls are not tagged.
    assert all(
        not (n.meta.get("custom") or {}).get(LOSS_PARALLEL_KEY)
        for n in graph.nodes
        if n.target is aten.mm.default and backward_index(n) is None
    )
    placed = {n.target for n in graph.nodes if getattr(n.meta.get("spmd"), "local_op", None) is not None}
    assert placed == {
        aten._log_softmax.default,
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten._log_softmax_backward_data.default,
    }


def test_second_reader_of_log_probs_keeps_the_unfused_backward(fake_mesh):
    """With label smoothing the log-probabilities also feed a sum: the gradient reaching the
    log-softmax is not the NLL's alone, so the NLL backward is not fused (DTensor's rules)."""
    compiled = compile_tiny_lm(fake_mesh, tp_cases.loss_parallel_smoothing_step)
    graph = compiled.last.traced.graph_module.graph
    placed = {n.target for n in graph.nodes if getattr(n.meta.get("spmd"), "local_op", None) is not None}
    assert aten._log_softmax.default in placed and aten.nll_loss_forward.default in placed
    assert aten.nll_loss_backward.default not in placed and aten._log_softmax_backward_data.default not in placed


def test_class_weights_keep_the_unfused_backward(fake_mesh):
    """torch's fused backward indexes class weights with ignored targets; with weights only the
    forward is vocab-parallel."""
    compiled = compile_tiny_lm(fake_mesh, tp_cases.loss_parallel_weighted_step)
    graph = compiled.last.traced.graph_module.graph
    placed = {n.target for n in graph.nodes if getattr(n.meta.get("spmd"), "local_op", None) is not None}
    assert placed == {aten._log_softmax.default, aten.nll_loss_forward.default}


def test_context_outside_tracing_changes_nothing():
    """On plain tensors (the single-device reference) loss_parallel() is a no-op."""
    logits, target = torch.randn(6, 5), torch.randint(0, 5, (6,))
    with loss_parallel():
        inside = F.cross_entropy(logits, target)
    torch.testing.assert_close(inside, F.cross_entropy(logits, target))
