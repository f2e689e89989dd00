"""Random ops: the compiled step draws what one device draws (see spmd_expand/rng.py).

Parity runs spawn 2 gloo ranks and compare 4 steps of dropout / noise / sampling models with the
single-device step over the global batch (same seed): losses, parameters, optimizer states, and the
generator state after every step. Graph tests on the fake process group check that random ops add
no communication beyond what their inputs' values need.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

import cases
import random_cases
import spmd_expand as spmd
from spmd_expand import rng
from spmd_expand.app.data import shard
from spmd_expand.graph_stats import collective_stats
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import GPTConfig, build_gpt, language_model_step

RTOL, ATOL = 1e-4, 1e-5
aten = torch.ops.aten

EAGER_RUNS = [
    ("ddp", "mlp_dropout"),
    ("ddp", "mlp_dropout_microbatch"),
    ("ddp", "noise"),
    ("ddp", "sampling"),
    ("ddp", "gpt_dropout"),
    ("fsdp", "mlp_dropout"),
    ("tp", "mlp_dropout"),
    ("tp", "noise"),  # replicated noise: every tensor-parallel rank draws the same values
    ("tp", "gpt_dropout"),  # attention-probability masks sharded over heads, residual masks replicated
]
INDUCTOR_RUNS = [("ddp", "mlp_dropout")]


@pytest.fixture(scope="module")
def results():
    memo: dict[str, list[dict]] = {}

    def get(lower: str) -> list[dict]:
        if lower not in memo:
            runs = EAGER_RUNS if lower == "eager" else INDUCTOR_RUNS
            memo[lower] = run_local(random_cases.run_random_cases, 2, runs, lower, timeout_s=600)
        return memo[lower]

    return get


def check(per_rank: list[dict], key: str) -> None:
    for rank, res in enumerate(per_rank):
        r = res[key]
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
        assert r["all_dtensor"]
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL, msg=lambda m: f"losses: {m}")
        for k in r["ref_params"]:
            torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"param {k}: {m}")
        assert r["states"].keys() == r["ref_states"].keys()
        for k in r["ref_states"]:
            torch.testing.assert_close(r["states"][k], r["ref_states"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"state {k}: {m}")
        # The generator advanced exactly as on one device (same ops, same global sizes, same order).
        assert r["generator_in_step"], f"rank {rank}: generator state differs from the single-device run"
    assert torch.equal(per_rank[0][key]["generator"], per_rank[1][key]["generator"]), "ranks' generators diverged"


@pytest.mark.parametrize("plan,name", EAGER_RUNS)
def test_random_parity_eager(results, plan, name):
    check(results("eager"), f"{plan}/{name}")


@pytest.mark.parametrize("plan,name", INDUCTOR_RUNS)
def test_random_parity_inductor(results, plan, name):
    """Inductor keeps ATen's random ops (fallback_random for this compilation), so values match."""
    check(results("inductor"), f"{plan}/{name}")


# ------------------------------------------------------------------ graphs (fake process group)
def _compiled(mesh, plan, model, step, batch):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = spmd.compile(mesh=mesh, plan=plan, lower="eager")(step)
    compiled(model, optimizer, *batch)
    return compiled.last.local_graph


def _ops(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


def test_dropout_adds_no_collective_under_ddp(fake_mesh):
    """The mask is drawn at global size from an uninitialized carrier and sliced: the activation it
    masks is never gathered, so the collectives are those of the same model without dropout."""
    world = fake_mesh.size()
    g = torch.Generator().manual_seed(0)
    x, y = cases._xy(g)
    batch = (shard(x, 0, world), shard(y, 0, world))
    with_dropout = _compiled(fake_mesh, spmd.DDP(), random_cases.DropoutMLP(0.3), cases.cross_entropy_step, batch)
    without = _compiled(fake_mesh, spmd.DDP(), random_cases.DropoutMLP(0.0), cases.cross_entropy_step, batch)
    assert collective_stats(with_dropout).as_dict() == collective_stats(without).as_dict()
    (draw,) = _ops(with_dropout, aten.native_dropout.default)
    carrier = draw.args[0]
    assert carrier.target is aten.empty_strided.default and carrier.args[0] == [cases.GLOBAL_BATCH, 32]
    (sliced,) = _ops(with_dropout, aten.slice.Tensor)
    assert sliced.args[1:] == (0, 0, cases.GLOBAL_BATCH // world)  # rank 0 keeps the first rows


def test_gpt_dropout_adds_no_collective_under_tp(fake_mesh):
    """Megatron TP: attention-probability masks are sliced over heads, residual masks replicated;
    the collectives are those of the GPT without dropout."""
    world = fake_mesh.size()
    idx, targets = cases._tokens(torch.Generator().manual_seed(0))
    graphs = {}
    for p in (0.2, 0.0):
        config = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=p)
        model = build_gpt(config)
        plan = spmd.TensorParallel(model.tensor_parallel_plan())
        graphs[p] = _compiled(fake_mesh, plan, model, language_model_step, (idx, targets))
    assert collective_stats(graphs[0.2]).as_dict() == collective_stats(graphs[0.0]).as_dict()
    draws = _ops(graphs[0.2], aten.native_dropout.default)
    assert len(draws) == 3  # attention weights and two residual branches
    head_slices = [n for n in _ops(graphs[0.2], aten.slice.Tensor) if n.args[1] == 1]
    assert [n.args[2:] for n in head_slices] == [(0, 4 // world)]  # rank 0's heads of the attention mask


# ------------------------------------------------------------------ classification
def _node(target, *args, **kwargs) -> fx.Node:
    graph = fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(target, tuple(x if a == "x" else a for a in args), kwargs)


@pytest.mark.parametrize(
    "target,args,kwargs,kind",
    [
        (aten.native_dropout.default, ("x", 0.1, True), {}, "dropout"),
        (aten.native_dropout.default, ("x", 0.1, False), {}, None),  # eval: no draw
        (aten.bernoulli.p, ("x", 0.5), {}, "like"),
        (aten.rand_like.default, ("x",), {}, "like"),
        (aten.uniform.default, ("x", 0.0, 1.0), {}, "like"),
        (aten.bernoulli.default, ("x",), {}, "values"),
        (aten.normal.Tensor_float, ("x", 1.0), {}, "values"),
        (aten.multinomial.default, ("x", 2), {}, "values"),
        (aten.rand.default, ([4, 4],), {}, "sizes"),
        (aten.randperm.default, (8,), {}, "sizes"),
        (aten._scaled_dot_product_efficient_attention.default, ("x", "x", "x", None, False, 0.1), {}, "unsupported"),
        (aten._scaled_dot_product_efficient_attention.default, ("x", "x", "x", None, False, 0.0), {}, None),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, ("x", "x", "x", 0.0), {}, None),
        (aten.add.Tensor, ("x", "x"), {}, None),
    ],
)
def test_classify(target, args, kwargs, kind):
    random_op = rng.classify(_node(target, *args, **kwargs))
    assert (random_op.kind if random_op else None) == kind


def test_placements_of_random_outputs():
    # A shard stays where the output keeps that dim's size; a dim that changes size is whole.
    assert rng.keep_shards((Shard(0), Shard(1)), (8, 4), (8, 2)) == (Shard(0), Replicate())
    # Dropout is linear in its input: a Partial input stays Partial, its mask is the same everywhere.
    value, mask = rng.dropout_placements((Shard(0), Partial("sum")))
    assert value == (Shard(0), Partial("sum")) and mask == (Shard(0), Replicate())
    value, mask = rng.dropout_placements((Partial("max"),))
    assert value == (Replicate(),) and mask == (Replicate(),)


class _GeneratorNoise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.fc(x + torch.rand(16, generator=self.generator))


class _BatchSizedGeneratorNoise(_GeneratorNoise):
    def forward(self, x):
        return self.fc(x + torch.rand(x.shape, generator=self.generator))  # sized by the batch: symbolic


def test_explicit_generator_is_an_error(fake_mesh):
    """The traced graph would hold a private copy of the generator: refused, with the fix."""
    world = fake_mesh.size()
    x, y = cases._xy(torch.Generator().manual_seed(0))
    with pytest.raises(spmd.UnsupportedOpError) as info:
        _compiled(fake_mesh, spmd.DDP(), _GeneratorNoise(), cases.cross_entropy_step, (shard(x, 0, world), shard(y, 0, world)))
    message = str(info.value)
    assert "explicit torch.Generator" in message and "aten.rand.generator" in message
    assert "torch.rand(16, generator=self.generator)" in message  # the user's source line
    assert "torch.manual_seed" in message


def test_an_explicit_generator_drawing_a_batch_sized_tensor_is_an_error_with_the_fix(fake_mesh):
    """Sized by the batch, the draw fails inside torch before it reaches the op check above (torch's
    generator kernels take concrete sizes only); the error names the line and the same fix."""
    world = fake_mesh.size()
    x, y = cases._xy(torch.Generator().manual_seed(0))
    with pytest.raises(spmd.TraceError) as info:
        _compiled(fake_mesh, spmd.DDP(), _BatchSizedGeneratorNoise(), cases.cross_entropy_step, (shard(x, 0, world), shard(y, 0, world)))
    message = str(info.value)
    assert "torch.rand(x.shape, generator=self.generator)" in message
    assert "a torch.Generator of your own" in message and "torch.manual_seed" in message
