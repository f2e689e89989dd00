"""Data parallelism divides the work: under DDP and FSDP each rank's compiled step does about 1/W of
the single-device step's FLOPs.

Graph-only (fake process group of 4 ranks, ``lower="eager"``, no passes). FLOPs are counted with
torch's flop registry (``torch.utils.flop_counter``: matmuls, convolutions, attention, forward and
backward) over the nodes of a graph, from the fake tensors in ``node.meta["val"]``
(:func:`spmd_expand.graph_stats.graph_flops`): the global traced
graph (global shapes; its symbolic batch size is evaluated at the traced batch) for one device, the
local graph (local shapes) for one rank. The global count is checked against ``FlopCounterMode`` on
the eager single-device forward and backward.

Cases: the demo GPT, a ResNet-18-shaped CNN with BatchNorm in train mode (``batch_norm_cases``),
and a tiny HuggingFace GPT-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import batch_norm_cases
import cases
import spmd_expand as spmd
from conftest import FAKE_WORLD_SIZE as W
from spmd_expand.graph_stats import collective_stats, graph_flops
from spmd_expand.passes import SyncBatchNorm
from spmd_expand.app.models import build_gpt, language_model_step

TOLERANCE = 1.15  # a rank may do at most 1.15/W of the single-device FLOPs


def eager_flops(model, forward_backward) -> int:
    """FLOPs of one device's forward and backward (FlopCounterMode) on a copy of ``model``."""
    model = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        forward_backward(model)
    return counter.get_total_flops()


def _cnn():
    torch.manual_seed(0)
    model = batch_norm_cases.ResNet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    batch_norm_cases._create_states(optimizer)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8 * W, 3, 16, 16, generator=g), torch.randint(0, 10, (8 * W,), generator=g)
    return model, optimizer, (x, y), batch_norm_cases.train_step, lambda m: F.cross_entropy(m(x), y).backward()


def _gpt():
    model = build_gpt(cases.GPT_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cases.GPT_CONFIG.vocab_size, (2 * W, cases.GPT_CONFIG.block_size), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    return model, optimizer, (idx, targets), language_model_step, lambda m: m(idx, targets).backward()


def _hf_gpt2():
    hf_zoo = pytest.importorskip("hf_zoo")
    model = hf_zoo.ZOO["gpt2"].build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, hf_zoo.VOCAB, (2 * W, hf_zoo.SEQ), generator=g)
    return model, optimizer, (ids, ids.clone()), hf_zoo.lm_step, lambda m: m(input_ids=ids, labels=ids).loss.backward()


CASES = {"gpt": _gpt, "resnet_bn": _cnn, "hf_gpt2": _hf_gpt2}
PLANS = {"ddp": spmd.DDP, "fsdp": spmd.FSDP}


def _compile(fake_mesh, case: str, plan: str, passes=()):
    model, optimizer, batch, step_fn, forward_backward = CASES[case]()
    single_device = eager_flops(model, forward_backward)
    step = spmd.compile(mesh=fake_mesh, plan=PLANS[plan](), lower="eager", passes=list(passes))(step_fn)
    step(model, optimizer, *(t[: t.shape[0] // W] for t in batch))  # rank 0's shard of the global batch
    return step, single_device


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("case", list(CASES))
def test_flops_per_rank_are_one_over_world(fake_mesh, case, plan):
    step, single_device = _compile(fake_mesh, case, plan)
    global_flops = graph_flops(step.last.traced.graph_module)
    local_flops = graph_flops(step.last.local_graph)
    # The traced step is the single-device step: the same forward and backward FLOPs.
    assert global_flops == single_device, (global_flops, single_device)
    ratio = local_flops * W / global_flops
    assert ratio <= TOLERANCE, (
        f"{case} under {plan}: a rank does {ratio:.2f}/W of the single-device FLOPs "
        f"({local_flops} of {global_flops}); collectives {collective_stats(step.last.local_graph).as_dict()}"
    )


@pytest.mark.parametrize("plan", list(PLANS))
def test_resnet_with_sync_batch_norm_divides_the_work(fake_mesh, plan):
    """With the sync_batch_norm pass on every BatchNorm (per-channel sums all-reduced), a rank still does
    1/W of the convolutions, and under DDP no activation is gathered."""
    step, single_device = _compile(fake_mesh, "resnet_bn", plan, passes=[SyncBatchNorm(by_cost=False)])
    ratio = graph_flops(step.last.local_graph) * W / single_device
    assert ratio <= TOLERANCE, ratio
    stats = collective_stats(step.last.local_graph).as_dict()
    if plan == "ddp":
        assert set(stats) == {"all_reduce"}, stats


def test_resnet_convolutions_run_on_the_local_batch(fake_mesh):
    """Every convolution (forward and backward) of the DDP ResNet reads this rank's rows only."""
    step, _ = _compile(fake_mesh, "resnet_bn", "ddp")
    local_batch = 8
    convs = [
        n for n in step.last.local_graph.graph.nodes
        if n.op == "call_function" and n.target in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
    ]
    assert len(convs) == 40
    for n in convs:
        x = n.args[0] if n.target is torch.ops.aten.convolution.default else n.args[1]
        assert x.meta["val"].shape[0] == local_batch, (n.name, tuple(x.meta["val"].shape))
