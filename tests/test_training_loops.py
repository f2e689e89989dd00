"""Real training-loop idioms keep the single-device promise, or are refused with a clear error.

Every scenario changes something between calls (LR schedulers, hyperparameters, train/eval, freezing,
new optimizer or model objects) or uses a common construct inside the step (zero_grad first,
``set_to_none=False``, gradients read through the module, gradient clipping), and compares 4+ steps
on 2 real gloo ranks with the same loop run eagerly on one device over the global batch.
"""

from __future__ import annotations

import pytest
import torch

import loops
from spmd_expand.app.launch import run_local

RTOL, ATOL = 1e-4, 1e-5

DDP = list(loops.SCENARIOS)
CLIP = ["clip_grad_norm", "clip_grad_value", "grads_through_module", "zero_grad_set_to_none_false"]
FSDP = CLIP + ["torch_compiled_model", "torch_compiled_block", "data_assignment_sgd", "data_assigned_then_written", "sam_sgd_momentum", "flat_vector_then_step", "load_full_state_dict_tied", "grad_data_clamp", "flat_vector_update", "ema_codebook_in_forward", "pgd_adversarial", "grad_data_in_hook", "lamb_python_int_step", "adamw_python_int_step_resumed", "adamw_python_int_step_in_group", "contrastive_clip", "mixup_randperm", "manual_sgd_no_optimizer", "gradient_penalty_double_backward", "buffer_assigned", "gradient_hooks", "forward_hook_added", "step_lr", "one_cycle_adam_foreach", "freeze_unfreeze", "zero_grad_first", "muon_fp32", "evaluate_inference_mode", "load_full_state_dict", "modes_set_inside_steps", "learnable_temperature_adamw", "lookahead_attribute_count_adamw", "float_argument_ema_teacher", "global_tensor_constants", "hf_distillation_annealed"]
TP = CLIP + ["cosine", "train_eval", "muon_fp32", "torch_compiled_model", "load_full_state_dict"]
TWO_D = ["clip_grad_norm", "grads_through_module"]
# Under the default lowering: Inductor would compile float hyperparameters in as constants
# (spmd_expand/tensorify.py); every one of these changes one between calls.
INDUCTOR = ["lr_set_directly_sgd", "step_lr", "one_cycle_adam_foreach", "betas_weight_decay_eps", "momentum", "cosine", "bf16_adamw_cosine", "float_argument_mixup", "global_tensor_constants", "global_scalar", "module_attribute"]
INDUCTOR_FSDP = ["step_lr", "one_cycle_sgd"]

# Compilations per loop: AdamW's lazy state is created before tracing, so a loop compiles once even
# while its learning rate and other hyperparameters change every step.
ONE_COMPILATION = [
    "lr_set_directly_adamw",
    "step_lr",
    "cosine",
    "linear_warmup",
    "one_cycle_adam_foreach",
    "betas_weight_decay_eps",
    "clip_grad_norm",
    "adam_foreach_deep",
    "module_attribute_not_read",
    "buffer_assigned",
    "forwarding_wrapper_adamw",  # the wrapped AdamW's state is created before tracing too
    "float_argument_mixup",  # a float argument of the step is a graph input, like lr
    "float_argument_ema_teacher",
    "global_tensor_constants",  # tensors the step reads from globals are graph inputs, changed in place or replaced
    "global_scalar",  # so are floats it reads from a global, a closure variable or a module attribute
    "closure_scalar",
    "module_attribute",
    "hf_distillation_annealed",  # a HuggingFace model in a user's wrapper, three floats annealed every step
]


@pytest.fixture(scope="module")
def results():
    memo: dict = {}

    def get(plan: str, names: list[str], world: int = 2, lower: str = "eager") -> list[dict]:
        if (plan, lower) not in memo:
            memo[plan, lower] = run_local(loops.run_scenarios, world, names, plan, lower, timeout_s=600)
        return memo[plan, lower]

    return get


# bfloat16 parameters and states: gradients summed over ranks in another order round differently
# (one or two bf16 ulps, ~4e-3 at 0.5). A stale learning rate in "bf16_adamw_cosine" is off by ~2e-2.
BF16_TOLERANCE = {"bf16_adamw_cosine": (2e-2, 5e-3)}


def check(per_rank: list[dict], name: str) -> dict:
    rtol, atol = BF16_TOLERANCE.get(name, (RTOL, ATOL))

    def _close(actual, expected, what):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")

    for rank, res in enumerate(per_rank):
        r = res[name]
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
        for i, (out, ref) in enumerate(zip(r["outs"], r["ref_outs"])):
            _close(out, ref, f"step {i} returned values")
        assert r["params"].keys() == r["ref_params"].keys()
        for k in r["ref_params"]:
            _close(r["params"][k], r["ref_params"][k], f"param {k}")
        assert r["buffers"].keys() == r["ref_buffers"].keys()
        for k in r["ref_buffers"]:
            _close(r["buffers"][k], r["ref_buffers"][k], f"buffer {k}")
        assert r["states"].keys() == r["ref_states"].keys()
        for k in r["ref_states"]:
            _close(r["states"][k], r["ref_states"][k], f"state {k}")
        assert len(r["evals"]) == len(r["ref_evals"])
        for i, (out, ref) in enumerate(zip(r["evals"], r["ref_evals"])):
            _close(out, ref, f"evaluation output {i}")
    return per_rank[0][name]


@pytest.mark.parametrize("name", DDP)
def test_ddp(results, name):
    check(results("ddp", DDP), name)


@pytest.mark.parametrize("name", INDUCTOR)
def test_ddp_inductor_hyperparameters_stay_inputs(results, name):
    # Hyperparameters reach Inductor as 0-d tensors: no compilation per new value.
    r = check(results("ddp", INDUCTOR, lower="inductor"), name)
    assert r["compilations"] == (2 if name == "momentum" else 1)
    assert r["inductor_compilations"] == 1  # (momentum's first graph creates the buffers: run eagerly)


@pytest.mark.parametrize("name", INDUCTOR_FSDP)
def test_fsdp_inductor_hyperparameters_stay_inputs(results, name):
    check(results("fsdp", INDUCTOR_FSDP, lower="inductor"), name)


@pytest.mark.parametrize("name", FSDP)
def test_fsdp(results, name):
    check(results("fsdp", FSDP), name)


@pytest.mark.parametrize("name", TP)
def test_tensor_parallel(results, name):
    check(results("tp", TP), name)


@pytest.mark.parametrize("name", TWO_D)
def test_fsdp_tp_2x2(results, name):
    check(results("fsdp+tp", TWO_D, world=4), name)


@pytest.mark.parametrize("name", ONE_COMPILATION)
def test_one_compilation_per_loop(results, name):
    assert check(results("ddp", DDP), name)["compilations"] == 1


def test_recompiles_where_structure_changes(results):
    r = {name: check(results("ddp", DDP), name)["compilations"] for name in DDP}
    # SGD with momentum creates its buffer from the first gradient: first-call and steady graphs.
    assert r["one_cycle_sgd"] == 2
    assert r["train_eval"] == 2  # train and eval graphs, each compiled once
    assert r["freeze_unfreeze"] == 2
    assert r["new_optimizer"] == 3  # AdamW, then SGD's first-call and steady-state graphs
    assert r["new_model"] == 2
    assert r["gradient_hooks"] == 2  # hooks on fc1 only, then on fc1 and fc2
    assert r["forward_hook_added"] == 2  # without, with, then without again (cached)
    assert r["post_accumulate_grad_hook"] == 1
    # A Python-int step count in the optimizer's state: one graph per count (the first call creates it).
    assert r["lamb_python_int_step"] == loops.STEPS
    # A Lookahead's count in an attribute, reset at every sync: one graph per value (0, 1), reused.
    assert r["lookahead_attribute_count_adamw"] == 2


def test_refused_batches():
    per_rank = run_local(loops.run_bad_batches, 2, timeout_s=600)
    for rank, res in enumerate(per_rank):
        assert res["uneven_4_6"].startswith("BatchError"), res["uneven_4_6"]
        assert "rank 0: (4, 16) float32, (4,) int64" in res["uneven_4_6"]
        assert "rank 1: (6, 16) float32, (6,) int64" in res["uneven_4_6"]
        assert "rank 1: (3, 16)" in res["global_7"]
        assert "empty on batch dim 0" in res["empty_rank"], res["empty_rank"]
        assert "no batch dim 2" in res["missing_batch_dim"], res["missing_batch_dim"]
        assert res["different_constants"].startswith("BatchError: the ranks pass different non-tensor arguments"), res["different_constants"]
        sparse = res["sparse_on_rank_0"]
        assert sparse.startswith("BatchError: the step's batch tensors cannot be placed"), sparse
        assert "problem: not dense: tensor argument 0 has layout torch.sparse_coo" in sparse and "`t.to_dense()`" in sparse
        grad = res["requires_grad_on_rank_0"]
        assert grad.startswith("BatchError: the step's batch tensors require grad"), grad
        assert "problem: requires grad: tensor argument 0" in grad and "pass `t.detach()`" in grad, grad
        assert "rank 0: scale=1\n  rank 1: scale=2" in res["different_constants"], res["different_constants"]
        floats = res["different_float_arguments"]
        assert floats.startswith("BatchError: the ranks pass different float arguments"), floats
        assert "argument scale: rank 0 1.0, rank 1 2.0" in floats, floats
        tensors = res["different_global_tensors"]
        assert tensors.startswith("BatchError: the ranks hold different values of tensors the step reads"), tensors
        assert "buffer weight of global WEIGHTED_CRITERION of loops: values differ between rank 0 | rank 1" in tensors, tensors
        global_floats = res["different_global_floats"]
        assert global_floats.startswith("DivergenceError: the ranks hold different values of Python floats the step reads"), global_floats
        assert "global LOSS_SCALE of loops: rank 0 1.0, rank 1 0.5" in global_floats, global_floats
        lr = res["different_lr"]
        assert lr.startswith("DivergenceError: the ranks' optimizers have different hyperparameters"), lr
        assert "param_groups[0]['lr']: rank 0 0.025, rank 1 0.05" in lr and "step the LR scheduler on every rank" in lr
        assert res["different_lr_untouched"]
        # A fast-path rank (prologue run under its check, denominator in the check) meeting a full-path
        # one: the results of one device, and of two fast-path calls.
        assert res["mixed_paths_runner"] == "PrologueRunner"
        assert res["mixed_paths_equal"] and res["mixed_paths_match_one_device"]
        new, cached = res["eval_on_rank_0_new"], res["eval_on_rank_0_cached"]
        assert new.startswith("DivergenceError: the ranks would run different compiled graphs"), new
        assert "rank 0: compiles a new graph" in new and "rank 1: graph 1 (compiled earlier)" in new
        assert "model.training: rank 0 False, rank 1 True (and its submodules)" in cached, cached
        assert "rank 0: graph 1 (compiled earlier)\n  rank 1: graph 2 (compiled earlier)" in cached
        assert "model.train() / model.eval() on every rank" in cached
        seeded, drawn = res["seeded_by_rank"], res["extra_draw"]
        assert seeded.startswith("DivergenceError: the ranks do not run the same program"), seeded
        assert "in the random generator state at the start of the step" in seeded
        assert "rank 0: seed 0, state" in seeded and "rank 1: seed 1, state" in seeded
        assert drawn.startswith("DivergenceError: the ranks' random generators are in different states"), drawn
        assert "not seed + rank" in seeded and "not seed + rank" in drawn
        assert res["replicas_ddp_agree"] == res["replicas_fsdp_agree"] == 16  # 4 parameters, 3 AdamW states each
        edited = res["replicas_ddp_edited"]
        assert edited.startswith("DivergenceError: the ranks' replicas of 1 of 16 tensors hold different values"), edited
        assert "parameter fc2.bias (4,) ((Replicate(),)): values differ between rank 0 | rank 1" in edited
        assert "load checkpoints on every rank" in edited
        assert res["replicas_fsdp_edited"] == "no error: 16 tensors", res["replicas_fsdp_edited"]  # shards differ by design
        plain = res["replicas_plain"]
        assert "parameter fc1.weight (32, 16) (a plain tensor, replicated): values differ between rank 0 | rank 1" in plain, plain
        for name, doing in (
            ("load_model_on_rank_0", "rank 0: model.load_state_dict distributes 4 loaded tensors (fc1.weight, ...)"),
            ("load_optimizer_on_rank_0", "rank 0: the step distributes 12 plain optimizer states (loaded)"),
        ):
            text = res[name]
            assert text.startswith("DivergenceError: some ranks send loaded state from rank 0 to every rank"), text
            assert doing in text and "rank 1: calls loops.classification_step" in text and "load on every rank" in text, text
        assert res["loaded_on_every_rank"] == 16
        text = res["eval_step_on_rank_0"]
        assert text.startswith("DivergenceError: the ranks make different calls at the same time"), text
        assert "rank 0: calls loops.eval_loss_and_logits\n  rank 1: calls loops.classification_step" in text, text
        text = res["one_more_step_on_rank_0"]
        assert "rank 0: calls loops.classification_step\n  rank 1: calls spmd.check_replicas" in text, text
        assert "DataLoader(drop_last=True)" in text
        text = res["backend_uneven_4_6"]
        assert "DivergenceError: the ranks do not run the same program" in text, text
        assert "rank 0: arg" in text and "float32[8, 16]" in text and "float32[12, 16]" in text, text
        assert "fix: every rank must pass batch tensors of the same shapes" in text and "drop_last=True" in text, text
        tp, scalar = res["tp_different_batches"], res["ddp_different_scalars"]
        assert tp.startswith("BatchError: ranks that hold the same replicated batch tensor pass different values"), tp
        assert "argument 0 (4, 16) float32, replicated over mesh dim(s) [0]: values differ between rank 0 | rank 1" in tp
        assert "DistributedSampler(dataset, num_replicas=mesh['dp'].size()" in tp
        assert "argument 2 () float32, replicated over mesh dim(s) [0]" in scalar and "argument 0" not in scalar, scalar
        later = res["ddp_different_scalars_later"]
        assert later.startswith("BatchError: ranks that hold the same replicated batch tensor pass different values"), later
        assert "argument 2 () float32, replicated over mesh dim(s) [0]: values differ between rank 0 | rank 1 (rank 0 1.0, rank 1 2.0)" in later, later
        assert torch.isfinite(res["after"])
    assert per_rank[0]["uneven_4_6"] == per_rank[1]["uneven_4_6"]  # every rank raises the same error


def test_scheduler_inside_step_is_refused():
    for message in run_local(loops.scheduler_inside_step, 2, timeout_s=600):
        assert message.startswith("TraceError"), message
        assert "changed optimizer.param_groups[0] settings" in message and "'lr'" in message
        assert "scheduler.step() after the compiled step" in message


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_data_assignments_that_a_compiled_step_cannot_keep_are_refused(plan):
    for message in run_local(loops.run_refused_data_assignments, 2, plan, timeout_s=600):
        between = message["between_calls"]
        assert between.startswith("PlanError: parameter 'fc2.weight' was assigned with `.data = ...`"), between
        assert "the assignment was lost" in between and "p.copy_(distribute_tensor(value" in between
        alias = message["alias_read_after"]
        assert alias.startswith("TraceError: reads a tensor that aliased another one before its `.data` was assigned"), alias
        assert "return loss + old.sum()" in alias and "old = p.detach().clone()" in alias
        dtype = message["dtype_changed"]
        assert dtype.startswith("TraceError: the train step at") and "model.fc2.bias.data = model.fc2.bias.data.double()" in dtype, dtype
        assert "assigns a torch.float64 tensor of shape [4]" in dtype
        shared = message["shared_with_input"]
        assert shared.startswith("TraceError: assigns a tensor's `.data`"), shared
        assert "model.fc2.bias.data = SWA_BIAS" in shared and "p.copy_(value)" in shared, shared
        flat = message["flat_vector_returned"]
        assert flat.startswith("TraceError: assigns a tensor's `.data`") and "outlives the call" in flat, flat
        swap = message["set_storage"]
        assert swap.startswith("TraceError: Tensor.set_ makes a tensor alias another's storage"), swap
        assert "model.fc2.weight.set_(" in swap


def test_gan_two_compiled_steps_share_one_model():
    """DCGAN's loop: the discriminator and the generator step at different points with their own
    optimizers, so each is a compiled step of its own over the model holding both; the second step
    adopts the parameters the first one converted (its optimizer was built before). One compilation each."""
    per_rank = run_local(loops.run_gan, 2, ["ddp", "fsdp"], timeout_s=600)
    for rank, res in enumerate(per_rank):
        for plan, r in res.items():
            assert "error" not in r, f"rank {rank} {plan}:\n{r['error']}"
            torch.testing.assert_close(r["outs"], r["ref_outs"], rtol=RTOL, atol=ATOL)
            for k in r["ref_params"]:
                torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{plan} {k}: {m}")
            assert r["compilations"] == [1, 1], (plan, r["compilations"])


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_batch_views_and_state_carried_across_calls(plan):
    """A language model's ``data[:, :-1]`` / ``data[:, 1:]``, a transposed batch written in place, a
    transposed buffer and parameter, and an LSTM's hidden state returned by one call and passed back
    (sliced) to the next: same as one device. Non-contiguous batches failed before (the graph's
    ``view`` of the contiguous traced input)."""
    per_rank = run_local(loops.run_batch_layouts, 2, plan, timeout_s=600)
    for rank, res in enumerate(per_rank):
        for case in ("views", "written_in_place", "transposed_state", "rnn_state"):
            for loss, ref_loss in res[case]["losses"]:
                torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=f"{case} loss")
            for name, (value, ref_value) in res[case]["params"].items():
                torch.testing.assert_close(value, ref_value, rtol=RTOL, atol=ATOL, msg=f"{case} {name}")
        assert res["views"]["compilations"] == 1
        torch.testing.assert_close(res["written_in_place"]["mine"], res["written_in_place"]["ref_mine"])
        for state, ref_state in (res["rnn_state"]["state"], res["rnn_state"]["cell"]):
            torch.testing.assert_close(state, ref_state, rtol=RTOL, atol=ATOL)
        message = res["global_state_passed_back"]
        assert message.startswith("BatchError"), message
        assert "argument 3 has the rows of all 2 data-parallel ranks: a tensor an earlier call returned?" in message
        assert "`t.tensor_split(2, dim=1)[mesh.get_local_rank(0)]`" in message


def test_a_new_batch_shape_compiles_once_with_a_warning():
    """Dynamic padding (a batch per sequence length) compiles once per length: the second length
    warns, naming the shapes and the fix; a length seen before reuses its graph silently."""
    for res in run_local(loops.run_changing_batch_shapes, 2, timeout_s=600):
        for loss, ref_loss in res["losses"]:
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        assert res["compilations"] == 2
        assert len(res["warnings"]) == 1, res["warnings"]
        message, filename = res["warnings"][0]
        assert "compiling next_token_step for new batch shapes (2 shapes so far; argument 0: (4, 12) int64, before (4, 8) int64; argument 1: (4, 12) int64, before (4, 8) int64)" in message, message
        assert "pad_to_multiple_of" in message
        assert filename.endswith("loops.py"), filename  # points at the caller's line


def test_a_dict_batch_in_another_key_order_is_another_graph():
    for res in run_local(loops.run_argument_structures, 2, timeout_s=600):
        for loss, ref_loss in res["losses"]:
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        for param, ref_param in res["params"]:
            torch.testing.assert_close(param, ref_param, rtol=RTOL, atol=ATOL)
        assert res["compilations"] == [2, 2]
        assert len(res["warnings"]) == 2, res["warnings"]
        assert "(now model, optimizer, batch['target'], batch['x']; before model, optimizer, batch['x'], batch['target'])" in res["warnings"][0]
