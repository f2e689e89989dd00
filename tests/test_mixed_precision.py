"""Mixed precision with FSDP2's ``MixedPrecisionPolicy`` on ``spmd.FSDP`` / ``spmd.DDP``.

Parity: 2 real gloo ranks against torch's ``fully_shard`` with the same policy on one device over the
global batch (tests/mixed_precision_cases.py), at bf16 tolerances; the user's own ``torch.autocast``
against eager. Graph facts: parameters, gradients and optimizer states stay fp32, matmuls run in
``param_dtype``, and the collectives move half the bytes where the policy says bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import mixed_precision_cases as cases
import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import MLP
from spmd_expand.graph_stats import collective_stats

BF16 = torch.bfloat16
# bf16 has 8 significant bits: a loss near 4 is rounded to a multiple of 2**-5, so a reduction over
# ranks (in another order than one device's) may land two steps of 2**-5 away.
LOSS_ATOL = 2 * 2**-5
# AdamW moves an element by at most ~lr per step (plus weight decay); rounding that flips the sign of
# a near-zero gradient moves it the other way: at most 2 * lr per step apart.
ADAMW_PARAM_ATOL = 2 * cases.LR_ADAMW * cases.STEPS
SGD_PARAM_ATOL = 1e-3


@pytest.fixture(scope="module")
def results():
    per_rank = run_local(cases.run_cases, 2, list(cases.CASES), timeout_s=600)
    return per_rank


@pytest.mark.parametrize("name", list(cases.CASES))
def test_parity_with_fsdp2_on_one_device(results, name):
    model_name, _, policy_name, _ = cases.CASES[name]
    policy = cases.POLICIES[policy_name] if policy_name else None
    compute_bf16 = policy is None or policy.param_dtype is BF16  # autocast computes matmuls in bf16 too
    for rank, per_case in enumerate(results):
        r = per_case[name]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=0, atol=LOSS_ATOL)
        atol = SGD_PARAM_ATOL if model_name.startswith("mlp") else ADAMW_PARAM_ATOL
        for fqn, value in r["params"].items():
            torch.testing.assert_close(value, r["ref_params"][fqn], rtol=0, atol=atol, msg=lambda m: f"{fqn}: {m}")
        # Sharded parameters, gradients and optimizer states keep the parameters' dtype.
        assert r["param_dtypes"] == ["torch.float32"] and r["state_dtypes"] == ["torch.float32"]
        assert r["mm_dtypes"] == (["torch.bfloat16"] if compute_bf16 else ["torch.float32"])
        # The GPT's loss is computed from its logits (bf16 under param_dtype=bf16); the MLP steps take
        # `model(x).float()`.
        bf16_logits = policy is not None and policy.param_dtype is BF16 and policy.output_dtype is None
        # HF's causal-LM loss upcasts the logits to fp32 itself.
        expected_loss = BF16 if bf16_logits and model_name.startswith("gpt") else torch.float32
        assert r["loss_dtype"] == expected_loss


def test_per_backward_reduction(results):
    """Two backward calls in one step reduce twice (FSDP2's semantics: the gradient is reduced in
    reduce_dtype at the end of each backward, then accumulated in the parameter's dtype)."""
    counts = results[0]["mlp_microbatch_fsdp_bf16"]["counts"]
    assert counts["reduce_scatter"] == 2


def _bytes(mesh, plan) -> dict:
    torch.manual_seed(0)
    model = MLP(16, 64, 8, activation=nn.GELU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=plan, lower="eager")(cases.mse_step)
    step(model, optimizer, torch.randn(2, 16), torch.randn(2, 8))
    return dict(collective_stats(step.last.local_graph).bytes)


def test_bytes_communicated(fake_mesh):
    base = _bytes(fake_mesh, spmd.FSDP())
    bf16 = _bytes(fake_mesh, spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=BF16)))
    bf16_fp32 = _bytes(fake_mesh, spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)))
    assert bf16["all_gather"] * 2 == base["all_gather"] and bf16["reduce_scatter"] * 2 == base["reduce_scatter"]
    assert bf16_fp32["all_gather"] * 2 == base["all_gather"] and bf16_fp32["reduce_scatter"] == base["reduce_scatter"]
    ddp = _bytes(fake_mesh, spmd.DDP())
    compressed = _bytes(fake_mesh, spmd.DDP(mp_policy=MixedPrecisionPolicy(reduce_dtype=BF16)))
    assert compressed["all_reduce"] < ddp["all_reduce"]
    # The gradients' all-reduce halves; the fp32 loss all-reduce (a few bytes) does not.
    assert ddp["all_reduce"] - compressed["all_reduce"] >= 0.49 * ddp["all_reduce"]


def test_policy_errors(fake_mesh):
    model = MLP()
    step = spmd.compile(mesh=fake_mesh, plan=spmd.FSDP(mp_policy="bf16"), lower="eager")(cases.mse_step)
    with pytest.raises(spmd.PlanError, match="MixedPrecisionPolicy"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16), torch.randn(4, 4))
    with pytest.raises(spmd.PlanError, match="param_dtype"):
        spmd.parallelize(MLP(), fake_mesh, spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8)))
    with pytest.raises(spmd.PlanError, match="spmd.compile"):
        spmd.parallelize(MLP(), fake_mesh, spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=BF16)))
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plan = {
        "replicate": spmd.DDP(mp_policy=MixedPrecisionPolicy(reduce_dtype=BF16)),
        "shard": spmd.FSDP(mp_policy=MixedPrecisionPolicy(param_dtype=BF16)),
    }
    from spmd_expand.plans import resolve_plan

    with pytest.raises(spmd.PlanError, match="same mp_policy"):
        resolve_plan(plan, mesh_2d, MLP()).mixed_precision(MLP())
