"""torch's PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput in a TensorParallel plan.

Plan checks need no process group; graph checks compile on the fake 4-rank mesh and read where the
``layout`` markers at module boundaries moved values (parity on real ranks: test_tp_parity.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput

import cases
import spmd_expand as spmd
import tp_cases
from spmd_expand.ops import LAYOUT
from spmd_expand.plans import fqn_matches
from spmd_expand.trace import backward_index

B, T, D = tp_cases.BATCH, tp_cases.SEQ, tp_cases.DIM


def test_globs_match_one_name_per_star_as_parallelize_module():
    assert fqn_matches("layers.*.attn", "layers.0.attn")
    assert not fqn_matches("layers.*.attn", "layers.0.block.attn")
    assert not fqn_matches("layers.*", "layers.0.attn")
    assert fqn_matches("*.w?", "ff.w1") and not fqn_matches("ff", "")


def test_parameter_free_modules_take_boundary_styles():
    model = tp_cases.build_tiny_lm()
    tp = spmd.TensorParallel(tp_cases.PREPARE_OUTPUT)
    tp.bind(model)
    assert set(tp.module_layouts()) == {"ff", "ff.w1", "ff.w2", "scale"}  # scale has no parameters
    layouts = tp.module_layouts()["scale"]
    assert layouts.outputs == (Shard(1), Replicate()) and layouts.exact_outputs and layouts.inputs == ()
    # Boundary styles place no parameter; the Linears inside keep theirs.
    assert tp.param_placement("ff.w1.weight", model.ff.w1.weight) == Shard(0)
    assert tp.param_placement("norm.weight", model.norm.weight) == Replicate()


def test_prepare_module_input_layouts_follow_torch():
    model = tp_cases.build_tiny_lm()
    tp = spmd.TensorParallel({
        "ff": PrepareModuleInput(
            input_layouts=(Shard(1), None, Replicate()),
            desired_input_layouts=(Replicate(), Shard(0), None),
            input_kwarg_layouts={"gate": Shard(1)},
            desired_input_kwarg_layouts={"gate": None},
        )
    })
    tp.bind(model)
    layouts = tp.module_layouts()["ff"]
    # No input layout: left alone (torch ignores the desired one); no desired layout: the input one.
    assert layouts.inputs == (Replicate(), None, Replicate()) and layouts.exact_inputs
    assert layouts.kwargs == (("gate", Shard(1)),)


@pytest.mark.parametrize(
    "plan, match",
    [
        ({"ff.w1": ColwiseParallel(), "ff.*": ColwiseParallel()}, "matches both"),
        ({"norm": ColwiseParallel()}, "nn.Linear and nn.Embedding"),
        ({"ff": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Partial())}, "Replicate\\(\\) or Shard"),
        ({"blocks.*": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))}, "matches no submodule"),
    ],
)
def test_plan_errors(plan, match):
    with pytest.raises(spmd.PlanError, match=match):
        spmd.TensorParallel(plan).bind(tp_cases.build_tiny_lm())


class _TiedHead(nn.Module):
    """BERT's LM head in small: the head holds the bias itself, tied to its decoder Linear's."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(D, 8)
        self.bias = self.decoder.bias


def test_tied_parameter_of_a_module_no_style_shards_names_the_fix():
    # Sharding the decoder would shard the bias the head holds itself, which no torch style can shard:
    # the fix is to leave the decoder replicated, not (as for two Linears) to give both a style.
    model = nn.Module()
    model.head = _TiedHead()
    with pytest.raises(spmd.PlanError, match=r"'head' \(_TiedHead\) holds it itself.*leave 'head.decoder' without a sharding style"):
        spmd.TensorParallel({"head.decoder": ColwiseParallel()}).bind(model)


def test_style_that_is_not_a_tp_style():
    with pytest.raises(spmd.PlanError, match="PrepareModuleInput"):
        spmd.TensorParallel({"ff": spmd.DDP()})


def _compile(mesh, plan, step=tp_cases.lm_step):
    model = tp_cases.build_tiny_lm()
    compiled = spmd.compile(mesh=mesh, plan=spmd.TensorParallel(plan), lower="eager")(step)
    compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *tp_cases.tokens(torch.Generator().manual_seed(0)))
    return compiled


def _moves(compiled) -> set:
    """(source placements, target placements, global shape) of every forward layout marker."""
    moves = set()
    for n in compiled.last.traced.graph_module.graph.nodes:
        if n.target is LAYOUT and backward_index(n) is None:
            src, dst = n.args[0].meta["spmd"].output, n.meta["spmd"].output
            moves.add((src.placements, dst.placements, tuple(dst.tensor_meta.shape)))
    return moves


S1, S0, R = (Shard(1),), (Shard(0),), (Replicate(),)


def test_prepare_module_input_gathers_sequence_shards(fake_mesh):
    """torchtitan's pattern: the block's positional and keyword inputs arrive sequence-sharded
    (after a SequenceParallel norm) and are all-gathered where the block is called."""
    moves = _moves(_compile(fake_mesh, tp_cases.PREPARE_INPUT))
    assert (S1, R, (B, T, D)) in moves
    assert (S1, R, (B, T, 1)) in moves  # the gate keyword argument


def test_prepare_module_output_redistributes_outputs(fake_mesh):
    moves = _moves(_compile(fake_mesh, tp_cases.PREPARE_OUTPUT))
    assert (R, S1, (B, T, D)) in moves  # ff's replicated output, sequence-sharded
    assert (S1, R, (B, T)) in moves  # the second output of the parameter-free `scale`


def test_prepare_module_input_output(fake_mesh):
    moves = _moves(_compile(fake_mesh, tp_cases.PREPARE_INPUT_OUTPUT))
    assert (R, S1, (B, T, D)) in moves  # positional input
    assert (R, S0, (B, T, 1)) in moves  # keyword input
    # The output (gated by the batch-sharded gate) is asked for Shard(0), which it already is.
    assert any(dst == S0 and shape == (B, T, D) for _, dst, shape in moves)


def test_wrong_number_of_input_layouts_is_a_trace_error(fake_mesh):
    plan = {"ff": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))}
    with pytest.raises(spmd.TraceError, match="'ff': the plan gives 2 layouts but the module has 1"):
        _compile(fake_mesh, plan)


def test_layout_for_a_non_tensor_input_is_a_trace_error(fake_mesh):
    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = tp_cases.FeedForward()

        def forward(self, x):
            return self.ff(x, None)

    model = Caller()
    plan = {"ff": PrepareModuleInput(input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate()))}
    compiled = spmd.compile(mesh=fake_mesh, plan=spmd.TensorParallel(plan), lower="eager")(cases.mse_step)
    with pytest.raises(spmd.TraceError, match="position 1 is a NoneType"):
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, D))
