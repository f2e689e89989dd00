"""Parity: the compiled step on W gloo ranks equals the single-device step over the global batch.

Each configuration spawns its ranks once and runs many cases (see ``cases.py``); every case is then
checked as its own test: losses of 3 steps, final parameters and optimizer states, within the
design's fp32 tolerance (rtol=1e-4, atol=1e-5).
"""

from __future__ import annotations

import pytest
import torch

import cases
from spmd_expand.launch import run_local

RTOL, ATOL = 1e-4, 1e-5

EAGER_W2 = list(cases.CASES)
INDUCTOR_W2 = ["mlp_adamw_foreach", "mlp_sgd_momentum", "gpt_adamw"]
EAGER_W4 = ["mlp_adamw_fused", "mlp_microbatch", "view_expand", "arange"]


@pytest.fixture(scope="module")
def results():
    """Lazily run each (world size, lowering) configuration once for the whole module."""
    memo: dict[tuple[int, str], list[dict]] = {}

    def get(world: int, lower: str, names: list[str]) -> dict:
        key = (world, lower)
        if key not in memo:
            memo[key] = run_local(cases.run_cases, world, names, 3, lower, timeout_s=1200)
        return memo[key]

    return get


def check(per_rank: list[dict], name: str) -> None:
    for rank, res in enumerate(per_rank):
        r = res[name]
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
        assert r["all_dtensor"], "parameters are not DTensors after the first call"
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL, msg=lambda m: f"losses: {m}")
        assert r["params"].keys() == r["ref_params"].keys()
        for k in r["ref_params"]:
            torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"param {k}: {m}")
        assert r["states"].keys() == r["ref_states"].keys()
        for k in r["ref_states"]:
            torch.testing.assert_close(r["states"][k], r["ref_states"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"state {k}: {m}")


@pytest.mark.parametrize("name", EAGER_W2)
def test_ddp_eager_world2(results, name):
    check(results(2, "eager", EAGER_W2), name)


@pytest.mark.parametrize("name", INDUCTOR_W2)
def test_ddp_inductor_world2(results, name):
    check(results(2, "inductor", INDUCTOR_W2), name)


@pytest.mark.parametrize("name", EAGER_W4)
def test_ddp_eager_world4(results, name):
    check(results(4, "eager", EAGER_W4), name)
