"""Parity: the compiled step on W gloo ranks equals the single-device step over the global batch.

Each configuration spawns its ranks once and runs many cases (see ``cases.py``); every case is then
checked as its own test: losses of 3 steps, final parameters and optimizer states, within the
design's fp32 tolerance (rtol=1e-4, atol=1e-5).
"""

from __future__ import annotations

import pytest
import torch

import cases
from spmd_expand.app.launch import run_local

RTOL, ATOL = 1e-4, 1e-5

EAGER_W2 = list(cases.CASES)
# The fused optimizers: the default lowering stopped on them (no Meta kernel for the tensor-lr ops).
INDUCTOR_W2 = ["mlp_adamw_foreach", "mlp_adamw_staggered", "mlp_sgd_momentum", "gpt_adamw", "mlp_adamw_fused", "mlp_sgd_fused", "mlp_adagrad_fused"]
EAGER_W4 = ["mlp_adamw_fused", "mlp_microbatch", "view_expand", "arange"]

FSDP_W2 = [
    "mlp_sgd_momentum",
    "mlp_adam_foreach",
    "mlp_adamw_foreach",
    "mlp_adam_fused",
    "mlp_adamw_fused",
    "mlp_sgd_fused",
    "mlp_adagrad_fused",
    "mlp_adadelta_foreach",
    "mlp_rprop_foreach",
    "mlp_nadam_foreach",
    "mlp_adagrad_foreach",
    "mlp_rmsprop_foreach",
    "mlp_adamw_staggered",
    "explicit_renorm",
    "batch_order_statistics",
    "mlp_uneven",
    "mlp_microbatch",
    "gpt_adamw",
]
FSDP_KEEP_W2 = ["mlp_sgd_momentum", "mlp_adamw_fused", "mlp_uneven", "gpt_adamw"]
# mlp_uneven is mlp_adamw_foreach's model class, optimizer and step with 33 hidden and 5 output rows,
# which neither 2 nor 4 divides: it covers that case too.
FSDP_W4 = ["mlp_uneven", "mlp_microbatch"]
FSDP_INDUCTOR_W2 = ["mlp_uneven", "gpt_adamw", "mlp_adamw_fused", "mlp_adagrad_fused"]


@pytest.fixture(scope="module")
def results():
    """Lazily run each (world size, lowering) configuration once for the whole module."""
    memo: dict[tuple[int, str, str], list[dict]] = {}

    def get(world: int, lower: str, names: list[str], plan: str = "ddp") -> dict:
        key = (world, lower, plan)
        if key not in memo:
            memo[key] = run_local(cases.run_cases, world, names, 3, lower, plan, timeout_s=600)
        return memo[key]

    return get


def check(per_rank: list[dict], name: str, scale: float = 1.0) -> None:
    """Losses, parameters and optimizer states of every rank equal one device's, within the design's
    tolerance times ``scale``."""
    rtol, atol = RTOL * scale, ATOL * scale
    for rank, res in enumerate(per_rank):
        r = res[name]
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
        assert r["all_dtensor"], "parameters are not DTensors after the first call"
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=rtol, atol=atol, msg=lambda m: f"losses: {m}")
        assert r["params"].keys() == r["ref_params"].keys()
        for k in r["ref_params"]:
            torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=rtol, atol=atol, msg=lambda m: f"param {k}: {m}")
        assert r["states"].keys() == r["ref_states"].keys()
        for k in r["ref_states"]:
            torch.testing.assert_close(r["states"][k], r["ref_states"][k], rtol=rtol, atol=atol, msg=lambda m: f"state {k}: {m}")


@pytest.mark.parametrize("name", EAGER_W2)
def test_ddp_eager_world2(results, name):
    check(results(2, "eager", EAGER_W2), name)


@pytest.mark.parametrize("name", INDUCTOR_W2)
def test_ddp_inductor_world2(results, name):
    check(results(2, "inductor", INDUCTOR_W2), name)


@pytest.mark.parametrize(("plan", "cases_"), [("ddp", INDUCTOR_W2), ("fsdp", FSDP_INDUCTOR_W2)])
def test_inductor_adamw_update_is_one_kernel(results, plan, cases_):
    """The whole AdamW update of every local shard is one generated kernel (the optimizer pass's target).

    AdamW's first-moment update is ``exp_avg.lerp_(grad, 1 - beta1)``; Inductor fuses the updates of all
    parameters (single-tensor or foreach) into one ``cpp_fused_..._lerp_...`` kernel on CPU. (A
    ``fused=True`` AdamW is one ATen kernel, ``_fused_adamw``, which Inductor calls as it is.)
    """
    per_rank = results(2, "inductor", cases_, plan)
    adamw = [name for name in cases_ if cases.CASES[name].optimizer in ("adamw_foreach", "adamw_gpt", "adamw_staggered")]
    assert adamw
    for name in adamw:
        kernels = per_rank[0][name]["kernels"]
        assert kernels, "no Inductor kernels were captured"
        updates = [k for k in kernels if "lerp" in k]
        assert len(updates) == 1, f"{plan} {name}: AdamW update in {len(updates)} kernels: {updates}"


@pytest.mark.parametrize("name", EAGER_W4)
def test_ddp_eager_world4(results, name):
    check(results(4, "eager", EAGER_W4), name)


@pytest.mark.parametrize("name", FSDP_W2)
def test_fsdp_eager_world2(results, name):
    check(results(2, "eager", FSDP_W2, "fsdp"), name)


@pytest.mark.parametrize("name", FSDP_KEEP_W2)
def test_fsdp_no_reshard_eager_world2(results, name):
    check(results(2, "eager", FSDP_KEEP_W2, "fsdp_keep"), name)


@pytest.mark.parametrize("name", FSDP_W4)
def test_fsdp_eager_world4(results, name):
    check(results(4, "eager", FSDP_W4, "fsdp"), name)


@pytest.mark.parametrize("name", FSDP_INDUCTOR_W2)
def test_fsdp_inductor_world2(results, name):
    check(results(2, "inductor", FSDP_INDUCTOR_W2, "fsdp"), name)


TP_W2 = [
    "mlp_sgd",
    "mlp_adamw_foreach",
    "mlp_adam_fused",
    "mlp_uneven",
    "mlp_microbatch",
    "gpt_megatron_blocks",
    "gpt_adamw",  # + vocab-parallel embedding and column-wise head
    "gpt_sequence_parallel",  # + SequenceParallel LayerNorms, reduce-scattered row-wise outputs
]
TWO_D_W4 = ["mlp_uneven", "gpt_adamw"]


@pytest.mark.parametrize("name", TP_W2)
def test_tp_eager_world2(results, name):
    check(results(2, "eager", TP_W2, "tp"), name)


@pytest.mark.parametrize("plan", ["fsdp+tp", "ddp+tp", "hsdp"])
@pytest.mark.parametrize("name", TWO_D_W4)
def test_2d_eager_world4(results, plan, name):
    check(results(4, "eager", TWO_D_W4, plan), name)
