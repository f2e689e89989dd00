"""``torch.compile(model, backend="spmd")`` after ``spmd.parallelize``: the user's own training loop.

Parity on real gloo ranks (W=2; 2x2 for FSDP+TP) against one device over the global batch, with an
LR scheduler and gradient clipping in the loop (tests/compile_cases.py); errors on a fake process group.
"""

from __future__ import annotations

import importlib.metadata
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import compile_cases
import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.backend import spmd_backend

RTOL, ATOL = 1e-4, 1e-5

RUNS_W2 = [
    ("gpt", "ddp", "inductor"),
    ("gpt", "fsdp", "eager"),
    ("gpt", "tp", "eager"),
    ("gpt_loss_inside", "fsdp", "eager"),
    ("gpt_compiled_optimizer", "fsdp", "eager"),
    ("graph_break", "fsdp", "eager"),
    ("nested_graph_break", "ddp", "eager"),
    ("padded_cnn", "ddp", "eager"),
    ("fused_kernels", "ddp", "eager"),
    ("fused_kernels", "fsdp", "eager"),
    ("lstm", "ddp", "eager"),
    ("graph_break_accumulate", "ddp", "eager"),
    ("llama", "ddp", "eager"),
    ("llama", "fsdp", "eager"),
    ("llama", "tp", "eager"),
    ("t5", "fsdp", "eager"),
    ("gradient_hook", "ddp", "eager"),  # runs once, in eager autograd, on the reduced gradient
]
RUNS_W4 = [("gpt", "fsdp+tp", "eager"), ("llama", "fsdp+tp", "eager")]


@pytest.fixture(scope="module")
def results_w2():
    return run_local(compile_cases.run_loops, 2, RUNS_W2, 3, timeout_s=600)


@pytest.fixture(scope="module")
def results_w4():
    return run_local(compile_cases.run_loops, 4, RUNS_W4, 3, timeout_s=600)


# The single-case workers, all on one spawn of 2 ranks (compile_cases.run_workers).
LOSSES_OUTSIDE_GRAPHS = [
    "mse", "smooth_l1", "cross_entropy_ignore_index", "norm", "fill_diagonal", "l1_weighted",
    "write_through_view", "write_through_alias", "foreach_in_place", "gradient_penalty",
    "sized_boolean_mask", "sized_nonzero", "sized_unique",  # in compiled code: the mode breaks the graph there
    "dropout", "plain_noise",
]
REFUSED_OUTSIDE_GRAPHS = {  # name -> (error, what it says)
    "write_into_view_across_split": ("UnsupportedOpError", "writes in place into a tensor that has a view, or is one"),
    "write_into_view_of_view_across_split": ("UnsupportedOpError", "writes in place into a tensor that has a view, or is one"),
    "shape_in_place": ("UnsupportedOpError", "changes the shape of a DTensor in place"),
    "dropout_rank_seeds": ("DivergenceError", "seed every rank alike"),
    "plain_noise_rank_seeds": ("DivergenceError", "seed every rank alike"),
}
WORKER_CALLS = [
    ("eager_gradient_worker",),
    ("statistic_output_worker", "ddp"),
    ("statistic_output_worker", "fsdp"),
    ("statistic_output_worker", "ddp", 8),
    ("centered_rows_worker", "ddp"),
    ("centered_rows_worker", "fsdp"),
    *(("sequence_first_output_worker", plan, loss) for plan in ("ddp", "fsdp") for loss in ("nll", "ctc")),
    ("alternating_heads_worker", "ddp"),
    ("compiled_dropout_worker", "ddp", False),
    ("compiled_dropout_worker", "ddp", True),
    ("short_batch_on_one_rank_worker", "ddp"),
    ("alternating_heads_worker", "fsdp"),
    *(("loss_outside_graphs_worker", "ddp", name) for name in LOSSES_OUTSIDE_GRAPHS),
    ("loss_outside_graphs_worker", "fsdp", "mse"),
    ("loss_outside_graphs_worker", "fsdp", "fill_diagonal"),
    ("loss_outside_graphs_worker", "fsdp", "write_through_alias"),
    *(("loss_outside_graphs_worker", "ddp", name) for name in REFUSED_OUTSIDE_GRAPHS),
    # Graph-break workers: their second graph reads no parameters and is matched to the one live
    # parallelized model, so an earlier worker's model must be freed by then (run_workers collects it).
    *(("sum_across_break_worker", reduction) for reduction in ("sum", "mean", "norm")),
    ("count_read_as_number_worker",),
]


@pytest.fixture(scope="module")
def workers():
    return run_local(compile_cases.run_workers, 2, WORKER_CALLS, timeout_s=900)


def _worker(workers, *call) -> list[dict]:
    """Each rank's result of one ``WORKER_CALLS`` entry; a rank's error fails the test with its traceback."""
    per_rank = [res[call] for res in workers]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return per_rank


def _check(per_rank: list[dict], run: tuple) -> None:
    for rank, res in enumerate(per_rank):
        r = res[run]
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
        for k in r["ref_params"]:
            torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"param {k}: {m}")
        # clip_grad_norm_ saw the gradient of the global batch.
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=RTOL, atol=ATOL)
        assert r["loss_is_plain"], "the compiled model's result should be this rank's local tensor"
        assert r["grads_follow_params"], "param.grad should be a DTensor with its parameter's placements"
        # Later steps hit Dynamo's cache: nothing is compiled after the first step.
        assert r["compilations"] == r["compilations_after_first_step"] > 0
        if r["optimizer_compilations"] is not None:
            # torch.compile(optimizer.step) over the DTensor parameters: one graph for every LR the scheduler set.
            assert r["optimizer_compilations"] == 1, r["optimizer_compilations"]
    # Each rank's loss is its local batch's mean; their mean is the global batch's.
    mean_loss = torch.stack([res[run]["losses"] for res in per_rank]).mean(0)
    torch.testing.assert_close(mean_loss, per_rank[0][run]["ref_losses"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("run", RUNS_W2, ids=lambda r: "-".join(r))
def test_parity_world2(results_w2, run):
    _check(results_w2, run)


def test_graph_break_compiles_several_graphs(results_w2):
    # Hooks, the forward before the break and after it: more graphs than the model without a break.
    assert results_w2[0][("graph_break", "fsdp", "eager")]["compilations"] > results_w2[0][("gpt", "fsdp", "eager")]["compilations"]


def test_filling_a_sharded_batch_tensor_is_one_graph(results_w2):
    """T5's ``labels[..., 0] = start`` (``fill_.Tensor`` on a DTensor) compiles, not a graph break."""
    assert results_w2[0][("t5", "fsdp", "eager")]["compilations"] == 1


def test_fill_of_a_dtensor_keeps_its_placement(fake_mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate

    t = DTensor.from_local(torch.arange(8.0).view(2, 4), fake_mesh, [Shard(0)])
    t[..., 0] = 3  # fill_.Tensor on the column's view
    assert t.placements == (Shard(0),) and t.to_local()[:, 0].tolist() == [3.0, 3.0]
    r = DTensor.from_local(torch.zeros(4), fake_mesh, [Replicate()])
    r.fill_(torch.tensor(2.0))
    assert r.to_local().tolist() == [2.0] * 4
    # A partial tensor filled would sum to W times the value: refused, not computed.
    p = DTensor.from_local(torch.zeros(4), fake_mesh, [Partial()])
    with pytest.raises(Exception):
        p.fill_(torch.tensor(2.0))


@pytest.mark.parametrize("run", RUNS_W4, ids=lambda r: "-".join(r))
def test_parity_2d(results_w4, run):
    _check(results_w4, run)


def test_backend_is_registered_by_entry_point():
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert found.get("spmd") == "spmd_expand.backend:spmd_backend"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("spmd") is spmd_backend


# ---------------------------------------------------------------------------------------------- errors


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _backend_error(fn, *args) -> spmd.SpmdError:
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as info:
        fn(*args)
    error = info.value.inner_exception
    assert isinstance(error, spmd.SpmdError), repr(error)
    return error


def test_unknown_option_is_named(fake_mesh):
    plan = spmd.DDP()
    model = spmd.parallelize(_mlp(), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "bucket_mb": 4})
    error = _backend_error(compiled, torch.randn(2, 8))
    assert "bucket_mb" in str(error) and "passes" in str(error)


def test_mesh_mismatch_is_named(fake_mesh):
    plan = spmd.DDP()
    model = spmd.parallelize(_mlp(), fake_mesh, plan)
    other = init_device_mesh("cpu", (2, 2))
    compiled = torch.compile(model, backend="spmd", options={"mesh": other, "plan": plan})
    assert "'mesh'" in str(_backend_error(compiled, torch.randn(2, 8)))


def test_eager_call_of_parallelized_model_raises(fake_mesh):
    model = spmd.parallelize(_mlp(), fake_mesh, spmd.DDP())
    with pytest.raises(spmd.SpmdError, match="torch.compile"):
        model(torch.randn(2, 8))


@pytest.mark.parametrize("plan", [spmd.DDP(), spmd.FSDP()], ids=["ddp", "fsdp"])
def test_optimizer_built_before_parallelize_is_refused(fake_mesh, plan):
    # Its parameters are the tensors parallelize replaced: they get no gradients, so its step would
    # skip them all and train nothing. Stepping it raises before anything is updated.
    model = _mlp()
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    old = [p.detach().clone() for p in early.param_groups[0]["params"]]
    spmd.parallelize(model, fake_mesh, plan)
    with pytest.raises(spmd.PlanError, match=r"(?s)param_groups\[0\]\['params'\]\[0\].*build the optimizer after"):
        early.step()
    for p, before in zip(early.param_groups[0]["params"], old):
        assert torch.equal(p, before)
    torch.optim.AdamW(model.parameters(), lr=0.1).step()  # one built after: no error


def test_fsdp_parameters_keep_their_names_and_eager_reads(fake_mesh):
    # Sharded parameters are read in their compute placements only while Dynamo traces.
    model = _mlp()
    names = [n for n, _ in model.named_parameters()]
    spmd.parallelize(model, fake_mesh, spmd.FSDP())
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == names
    assert isinstance(model[0], nn.Linear)
    weight = model[0]._parameters["weight"]
    assert model[0].weight is weight and weight.placements == (Shard(0),)


def test_a_parallelized_model_is_freed_with_its_last_reference(fake_mesh):
    """The registry of parallelized models held each model through its boundary hooks' context
    managers: no model was freed, and a later graph that reads no parameters (the part after a graph
    break) matched every earlier one ("matches 8 parallelized models"). The hooks stay while it lives, and
    it can still be deep-copied."""
    import copy
    import gc
    import weakref

    from torch.distributed.tensor.parallel import ColwiseParallel

    model = spmd.parallelize(_mlp(), fake_mesh, spmd.TensorParallel({"0": ColwiseParallel()}))
    gc.collect()
    assert model[0]._forward_pre_hooks and model[0]._forward_hooks  # the style's layout markers
    copy.deepcopy(model)  # an EMA copy: the hook contexts (generators) are not copied
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_compiled_model_is_freed_after_its_last_reference_and_a_dynamo_reset(fake_mesh):
    """Dynamo keeps each compiled graph as a global of the forward's module (torch._dynamo.reset()
    leaves it); the backend's compiled graph held the trace's Python guards, and through them every
    module of the model: no compiled model was ever freed (a later graph reading no parameters then
    matched it too)."""
    import gc
    import weakref

    plan = spmd.DDP()
    model = spmd.parallelize(compile_cases.BreakMLP(), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    compiled(torch.randn(4, 12)).sum().backward()
    alive = weakref.ref(model)
    del model, compiled
    torch._dynamo.reset()
    gc.collect()
    assert alive() is None


def test_parallelize_again_after_dynamo_reset(fake_mesh):
    from torch._dynamo.callback import callback_handler

    class WithPositions(nn.Module):  # creates a plain tensor that meets DTensors (implicit replication)
        def __init__(self):
            super().__init__()
            self.mlp = _mlp()

        def forward(self, x):
            return self.mlp(x) + torch.arange(4.0)

    from spmd_expand.backend import _on_compile_start

    plan = spmd.DDP()
    model = spmd.parallelize(WithPositions(), fake_mesh, plan)
    torch._dynamo.reset()
    assert _on_compile_start not in callback_handler.start_callbacks
    assert spmd.parallelize(model, fake_mesh, plan) is model
    assert _on_compile_start in callback_handler.start_callbacks
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    assert compiled(torch.randn(2, 8)).shape == (2, 4)


def test_kv_cache_under_tensor_parallel_warns(fake_mesh):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(config)
    plan = spmd.TensorParallel.from_huggingface(model)
    with pytest.warns(UserWarning, match="use_cache"):
        spmd.parallelize(model, fake_mesh, plan)


def test_compute_on_local_result_inside_compiled_region_raises(fake_mesh):
    plan = spmd.DDP()
    model = spmd.parallelize(_mlp(), fake_mesh, plan)

    def loss_fn(x, y):  # the loss of a local tensor, inside the compiled region: a per-rank value
        return F.cross_entropy(model(x), y)

    compiled = torch.compile(loss_fn, backend="spmd", options={"mesh": fake_mesh, "plan": plan})
    error = _backend_error(compiled, torch.randn(2, 8), torch.randint(0, 4, (2,)))
    assert "to_local" in str(error) and "loss outside" in str(error)


def test_parameters_become_dtensors_with_the_plan(fake_mesh):
    plan = spmd.FSDP()
    model = spmd.parallelize(_mlp(), fake_mesh, plan)
    weight = model[0].weight
    assert isinstance(weight, torch.distributed.tensor.DTensor)
    assert weight.shape == (16, 8) and weight.to_local().shape == (4, 8)
    assert spmd.parallelize(model, fake_mesh, plan) is model  # idempotent
    with pytest.raises(spmd.SpmdError, match="already parallelized"):
        spmd.parallelize(model, fake_mesh, spmd.DDP())


def test_gradient_of_eager_dtensor_code_is_reduced_per_plan(workers):
    """Dynamo can run part of a model eagerly (a graph break inside a torch.nn module did, before the
    backend's forward ran under forms.EqualForms): eager DTensor autograd leaves a data-parallel
    gradient Partial; parallelize's hook reduces it (once per accumulation) and warns once."""
    from torch.distributed.tensor import Replicate

    per_rank = _worker(workers, "eager_gradient_worker")
    for r in per_rank:
        assert r["placements"] == (Replicate(),)
        # Two backward calls, each summing 2 rows of value 1 (rank 0) and 2 (rank 1): 2 * (2 + 4).
        torch.testing.assert_close(r["grad"], torch.full((1, 4), 12.0))
        assert len(r["warnings"]) == 1


@pytest.mark.parametrize(
    "plan,name",
    [("ddp", name) for name in LOSSES_OUTSIDE_GRAPHS] + [("fsdp", "mse"), ("fsdp", "fill_diagonal"), ("fsdp", "write_through_alias")],
)
def test_eager_dtensor_code_in_the_forward_runs_as_one_device(workers, plan, name):
    """A loss under ``torch._dynamo.disable`` inside the compiled model ran on DTensor's eager rules:
    torch 2.13 gave 2x the gradients of a mean MSE on 2 ranks (an FSDP parameter read there too),
    averaged the ranks' means of a cross-entropy with unevenly ignored labels, wrote no diagonal into
    the row-split tensor, all silently. forward's mode (eager_fallback.ForwardMode) runs such calls on
    full values, and warns at the user's line. Writes through views and aliases (``h[:, 0].zero_()``,
    ``h.contiguous().mul_(2)``: the tensor itself on one device) reach the tensor, and autograd sees them;
    ``torch._foreach_mul_`` writes its list, ``torch.autograd.grad`` differentiates the DTensors themselves.
    Calls sized by values in compiled code (``h[mask]``, ``torch.nonzero``, ``torch.unique``) stopped
    Dynamo with a sharding error; the mode breaks the graph at them, and they run here."""
    for r in _worker(workers, "loss_outside_graphs_worker", plan, name):
        torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-5, atol=1e-6)
        for got, ref in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        assert any("outside Dynamo's graphs" in w for w in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("name", list(REFUSED_OUTSIDE_GRAPHS))
def test_eager_writes_the_fallback_cannot_keep_are_refused(workers, name):
    """Writes through an alias are kept where DTensor gives the view too (the cases above); a view
    across the split dim (``h[0]`` of row-split rows) is a gathered copy here, so a write into it
    would reach only one side: refused, as is a shape change in place DTensor has no rule for (a raw
    sharding-propagation error before), and a random draw from generators seeded per rank (each rank
    drew its own "replicated" mask: replicas that differ, silently)."""
    for rank, res in enumerate(workers):
        error = res[("loss_outside_graphs_worker", "ddp", name)].get("error", "")
        kind, says = REFUSED_OUTSIDE_GRAPHS[name]
        assert kind in error and says in error and "fix" in error, f"rank {rank}:\n{error}"


def test_a_compiled_graph_that_draws_checks_the_generators_on_every_call(workers):
    """A compiled graph that draws (dropout) keeps each rank's slice of one draw from the rank's own
    generator. Compiling it checked that the generators agree; later calls did not, so a draw on rank 0
    alone between calls gave each rank's rows another mask than one device's, silently (a loss of
    1.3307 against one device's 1.3731; a replicated draw would differ across the replicas). Now
    every call checks: with the ranks seeded alike, three calls equal one device's; after rank 0's own
    draw, the third call raises on both ranks before the graph runs."""
    for res in workers:
        calls = res[("compiled_dropout_worker", "ddp", False)]["calls"]
        assert len(calls) == 3 and "error" not in calls[-1], calls[-1].get("error")
        for c in calls:
            torch.testing.assert_close(c["loss"], c["ref_loss"], rtol=1e-5, atol=1e-6)
            for got, ref in zip(c["grads"], c["ref_grads"]):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for rank, res in enumerate(workers):
        calls = res[("compiled_dropout_worker", "ddp", True)]["calls"]
        assert len(calls) == 3 and all("error" not in c for c in calls[:2]), calls
        error = calls[2].get("error", "")
        assert "DivergenceError" in error and "in a call of" in error and "random generator state:" in error, f"rank {rank}:\n{error}"
        assert "seed every rank alike" in error


def test_a_short_batch_on_one_rank_after_the_first_call_raises_on_every_rank(workers):
    """A short batch on rank 0 alone at the third call: Dynamo's guards fail there only, so rank 0
    compiled a new graph while rank 1 ran the one it had, into its first all-reduce, and both waited
    until the timeouts (rank 1 in gloo, rank 0 in compilation's cross-rank check; still waiting after
    300 s). Every call of a graph with collectives now checks across ranks which graph it runs: both
    ranks raise at once, before any collective, naming the fix."""
    for rank, res in enumerate(workers):
        calls = res[("short_batch_on_one_rank_worker", "ddp")]["calls"]
        assert len(calls) == 3 and all("error" not in c for c in calls[:2]), calls
        error = calls[2].get("error", "")
        assert "DivergenceError" in error and "did not reach it" not in error, f"rank {rank}:\n{error}"
        if rank == 0:  # it compiles: its check of the new global graph met rank 1's check of a call
            assert "check of the global graph of the step" in error and "check of a call of" in error, error
        else:
            assert "in a call of a Sequential graph of torch.compile" in error and "a batch of another shape" in error, error


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_an_output_not_split_over_the_ranks_is_its_full_value(workers, plan):
    """A statistic over the batch returned by the compiled model (``h.mean(0)``, shape [5]) was
    redistributed to the batch's placement like rows: each rank got a slice of it ([3] and [2]), and
    a loss on it differed from one device's, silently. An output split nowhere now returns its full
    value (as a scalar did), and its gradient matches one device's."""
    for r in _worker(workers, "statistic_output_worker", plan):
        assert not [w for w in r["warnings"] if "statistic over the batch" in w], r["warnings"]
        torch.testing.assert_close(r["statistic"], r["ref_statistic"])
        for got, ref in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_a_statistic_as_wide_as_the_global_batch_is_not_silent(workers):
    """``h.mean(0)`` with 8 features and a global batch of 8: its placements (split nowhere) cannot
    tell it from rows every rank computed, and it is split like rows ([4] on each rank, losses 18-42%
    off); it was silent. Now it warns, naming the shape and what to do."""
    for r in _worker(workers, "statistic_output_worker", "ddp", 8):
        assert r["shape"] == (4,)
        assert any("statistic over the batch whose width" in w and "(8,)" in w for w in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_rows_centered_over_the_batch_are_this_ranks_rows(workers, plan):
    """``h - h.mean(0, keepdim=True)``, a partial value with the batch's rows: each rank gets its rows
    and one device's gradients (a rule taking every partial output as a statistic returned the full
    (B, C) value, which broadcast silently against one row of targets)."""
    for r in _worker(workers, "centered_rows_worker", plan):
        assert r["shape"] == (1, 3)
        for got, ref in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["nll", "ctc"])
@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_a_sequence_first_output_keeps_its_split_dim(workers, plan, loss):
    """A batch-first input and a sequence-first output ``(T, B, C)`` (a CTC model's log-probabilities):
    the output, split on dim 1, was redistributed to the plan's Shard(0), so each rank got half the time
    steps of every sample ((4, 4, 5) instead of (8, 2, 5)): an NLL paired them with the wrong targets
    (losses 1.7156 vs 1.5769, silently) and ctc_loss raised a raw RuntimeError. Rows stay on their dim."""
    per_rank = _worker(workers, "sequence_first_output_worker", plan, loss)
    torch.testing.assert_close(sum(r["loss"] for r in per_rank) / len(per_rank), per_rank[0]["ref_loss"])
    for r in per_rank:
        assert r["shape"] == (8, 2, 5)
        for got, ref in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_an_output_no_loss_uses_gives_its_parameters_no_gradient(workers, plan):
    """A multi-task loop training one of two heads per step: the unused head's parameters got zero
    gradients (the backward graph ran with zero tangents), where eager autograd gives none, so AdamW
    decayed them and moved their moments: head_a's weight ended 1.2e-2 off one device, silently (stock
    torch.compile does the same on one device). A gradient no used output reaches is None now."""
    for r in _worker(workers, "alternating_heads_worker", plan):
        assert r["unused_grad_none"] == [True, True]
        for got, ref in zip(r["params"], r["ref_params"]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean", "norm"])
def test_a_reduction_over_the_batch_across_a_graph_break_gets_one_devices_gradient(workers, reduction):
    """A partial value (a reduction over the batch) leaving one graph for the next at a break. A sum's
    gradient came back declared partial too, and was summed over the ranks again: the first layer's
    gradient was W times one device's, silently (HF Llama with num_items_in_batch and a printing
    forward hook: lm_head's gradient norm 1.4724 where one device had 0.7362); a mean or a norm stopped
    with a PlacementError (S(0) to P(avg); P(sum) to _NormP(2)). Partial values leave a graph reduced."""
    for r in _worker(workers, "sum_across_break_worker", reduction):
        for got, ref in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_a_count_over_the_batch_read_as_a_number_is_the_global_count(workers):
    """``n = (labels >= 0).sum().item()`` inside forward: Dynamo breaks the graph there and the sum
    left the first graph partial, so ``.item()`` read this rank's part (4 of 8): the loss was twice one
    device's, silently. Partial values leave a graph reduced now."""
    for r in _worker(workers, "count_read_as_number_worker"):
        torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-4, atol=1e-6)  # a scalar: its full value
        for got, ref in zip(r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_a_data_parallel_split_of_a_sequence_first_input_is_refused(fake_mesh):
    """As under spmd.compile (tests/test_errors.py): sequence-first data into a batch_first=False
    Transformer layer with batch_dim=0 is refused while Dynamo traces, naming the module."""
    torch.manual_seed(0)
    plan = spmd.DDP()
    model = spmd.parallelize(nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), nn.Linear(16, 4)), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    try:
        with pytest.raises(spmd.PlanError, match=r"module '0.self_attn' \(batch_first=False\) reads dim 0") as info:
            compiled(torch.randn(6, 4, 16))
        assert "batch_dim=1" in str(info.value) and "input placements: (Shard(dim=0),)" in str(info.value)
    finally:
        # A compilation that raised leaves Dynamo state behind that broke a later model with another
        # batch_dim in this process (torch 2.13: a DTensorSpec shard_order error); start clean.
        torch._dynamo.reset()


def test_a_sparse_argument_is_refused(fake_mesh):
    """As under spmd.compile (tests/test_errors.py): DTensor.from_local of a sparse tensor failed in
    a raw view error while Dynamo traced; the wrapped forward names the argument and the fix."""
    plan = spmd.DDP()
    model = spmd.parallelize(_mlp(), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    try:
        with pytest.raises(spmd.BatchError, match=r"forward: a tensor argument has layout torch.sparse_coo.*to_dense"):
            compiled(torch.randn(4, 8).to_sparse())
    finally:
        torch._dynamo.reset()


def test_a_recurrent_module_without_allow_rnn_is_refused_before_conversion(fake_mesh):
    """Without torch._dynamo.config.allow_rnn, Dynamo runs nn.LSTM eagerly on DTensors, whose raw
    mixed-tensor error came at the first call; parallelize refuses it at once, naming the module and
    the flag, and leaves the model as it was (with the flag: the "lstm" run of compile_cases)."""
    model = nn.Sequential(nn.Embedding(20, 6), nn.LSTM(6, 8, batch_first=True))
    allow_rnn = torch._dynamo.config.allow_rnn
    torch._dynamo.config.allow_rnn = False
    try:
        with pytest.raises(spmd.PlanError, match=r"LSTM '1': with torch._dynamo.config.allow_rnn off") as info:
            spmd.parallelize(model, fake_mesh, spmd.DDP())
    finally:
        torch._dynamo.config.allow_rnn = allow_rnn
    assert "allow_rnn = True before spmd.parallelize" in str(info.value) and "spmd.compile" in str(info.value)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def block(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def test_activation_checkpointing_of_sharded_parameters_is_refused_with_the_fix(fake_mesh):
    """Under FSDP the checkpointed region reads its parameters gathered (a ``redistribute`` inside the
    higher-order op's body, which runs outside the backend's interpreter): an SpmdError naming the
    op, the user's line and spmd.compile (was a TraceError inside torch's wrap op blaming the batch dim)."""
    torch._dynamo.reset()
    plan = spmd.FSDP()
    model = spmd.parallelize(_Checkpointed(), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    error = _backend_error(lambda x: compiled(x).sum().backward(), torch.randn(4, 8))
    assert "tag_activation_checkpoint (at File" in str(error) and "test_torch_compile.py" in str(error), str(error)
    assert "compile the whole step with spmd.compile" in str(error) and "batch_dim" not in str(error), str(error)


class _Prints(nn.Module):
    """A forward with a print (Dynamo breaks the graph there and runs it on every call)."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        print("h", tuple(h.shape), file=self.sink)
        return self.b(h)


def test_a_print_in_the_forward_is_not_warned_about(fake_mesh):
    """spmd.compile warns that a step's print() runs only while traced; the backend said the same of
    a print in the forward ("spmd.compile: the step calls print()"), which Dynamo runs on every call."""
    plan = spmd.DDP()
    sink = io.StringIO()
    model = spmd.parallelize(_Prints(sink), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                compiled(torch.randn(2, 8)).sum().backward()
        assert not [w for w in caught if "print()" in str(w.message)], [str(w.message) for w in caught]
        assert sink.getvalue().count("h (8, 8)") == 2  # the global shape, printed on each call
    finally:
        torch._dynamo.reset()


def test_two_models_with_one_plan_object_and_a_graph_break_name_the_fix(fake_mesh):
    """The graph after a graph break reads no parameters and is matched to its model by the options'
    mesh and plan objects: two models parallelized with one plan object cannot be told apart, and the
    error said only "matches 2 parallelized models"; it names the fix."""
    plan = spmd.DDP()
    first = spmd.parallelize(_Prints(io.StringIO()), fake_mesh, plan)
    second = spmd.parallelize(_Prints(io.StringIO()), fake_mesh, plan)
    compiled = torch.compile(first, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    try:
        with pytest.raises(Exception, match=r"matches 2 parallelized models .*own plan object"):
            compiled(torch.randn(2, 8))
    finally:
        del second
        torch._dynamo.reset()
