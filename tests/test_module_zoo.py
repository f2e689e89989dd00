"""torch.nn's own layers keep the single-device promise under DDP (and a few under FSDP), or are
refused clearly; see tests/module_zoo_cases.py."""

from __future__ import annotations

import pytest
import torch

import module_zoo_cases as zoo
from spmd_expand.app.launch import run_local

FSDP = ["conv2d_groupnorm_pools", "conv3d_pools", "token_pool_adaptive_avg_pool1d", "transformer_encoder", "weight_norm_spectral_norm", "lstm"]


@pytest.fixture(scope="module")
def results():
    memo = {}

    def get(plan: str) -> list[dict]:
        if plan not in memo:
            names = [*zoo.MODELS, *zoo.REFUSED] if plan == "ddp" else FSDP
            memo[plan] = run_local(zoo.run_models, 2, plan, names, timeout_s=900)
        return memo[plan]

    return get


@pytest.mark.parametrize("plan,name", [("ddp", n) for n in zoo.MODELS] + [("fsdp", n) for n in FSDP])
def test_gradients_match_one_device(results, plan, name):
    for rank, per_model in enumerate(results(plan)):
        r = per_model[name]
        assert "error" not in r and "refused" not in r, f"rank {rank}:\n{r.get('error') or r.get('refused')}"
        torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-5, atol=1e-6)
        for i, (grad, ref) in enumerate(zip(r["grads"], r["ref_grads"])):
            torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"gradient {i}: {m}")


@pytest.mark.parametrize("name", list(zoo.REFUSED))
def test_layers_without_a_rule_are_refused(results, name):
    op = zoo.REFUSED[name][1]
    for rank, per_model in enumerate(results("ddp")):
        r = per_model[name]
        assert "refused" in r, f"rank {rank}: expected UnsupportedOpError, got {r}"
        assert op in r["refused"] and "register_sharding" in r["refused"]
