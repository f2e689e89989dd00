"""Fuzzed parity in `make test`: seeded random models and optimizers (tests/fuzz_cases.py) under DDP,
FSDP and TP on 2 real gloo ranks, and FSDP+TP, DDP+TP and HSDP on a 2x2 mesh of 4, each against the
single-device run over the global batch.

A bounded set of seeds here; ``python bench/fuzz.py --seeds 1000`` runs thousands. A seed that ever
failed is kept in ``REGRESSIONS`` with what it found.
"""

from __future__ import annotations

import fuzz_cases
import pytest

from spmd_expand.app.launch import run_local

SEEDS = list(range(10))  # the first 10 draw every block kind and optimizer
SEEDS_2D = list(range(4))  # 4 ranks on a 2-core machine: fewer
REGRESSIONS: dict[int, str] = {
    13: "generator: a batch-centering block made a bias gradient 0 +- 3e-8, amplified to +-lr by Adam (now added)",
}


@pytest.fixture(scope="module")
def results():
    return run_local(fuzz_cases.run_fuzz, 2, sorted(set(SEEDS) | set(REGRESSIONS)), timeout_s=1200)


@pytest.fixture(scope="module")
def results_2d():
    return run_local(fuzz_cases.run_fuzz, 4, SEEDS_2D, fuzz_cases.PLANS_2D, timeout_s=1200)


def _check(results, plan, seeds):
    failures = []
    for rank, per_rank in enumerate(results):
        for (seed, case_plan), result in sorted(per_rank.items()):
            if case_plan == plan and not result["ok"]:
                failures.append(f"rank {rank}, {result['case']}: {result['why']}")
    assert not failures, "\n".join(failures)
    assert sum(p == plan for _, p in results[0]) == len(seeds)


@pytest.mark.parametrize("plan", fuzz_cases.PLANS)
def test_random_models_match_one_device(results, plan):
    _check(results, plan, set(SEEDS) | set(REGRESSIONS))


@pytest.mark.parametrize("plan", fuzz_cases.PLANS_2D)
def test_random_models_match_one_device_2d(results_2d, plan):
    _check(results_2d, plan, SEEDS_2D)


def test_cases_cover_the_generator():
    # The bounded set still draws every block kind and every optimizer.
    kinds, optimizers = set(), set()
    for seed in SEEDS:
        case = fuzz_cases.random_case(seed)
        kinds |= {block.kind for block in case.model().blocks}
        optimizers.add(case.description.split(":")[1].split()[0])
    assert optimizers == {"sgd", "sgd_momentum", "adam", "adamw"}, optimizers
    assert kinds == {"linear", "residual", "cat", "norm", "transpose", "center", "rms", "pool"}, kinds
