"""Ranks that disagree get a DivergenceError on every rank before any collective, never a hang.

Real gloo ranks (W=2), tests/divergence_cases.py; the check itself is spmd_expand/rank_check.py.
"""

from __future__ import annotations

import pytest

import divergence_cases
from spmd_expand.app.launch import run_local


@pytest.fixture(scope="module")
def results():
    return run_local(divergence_cases.run_cases, 2, timeout_s=600)


def _errors(results, case):
    errors = [r[case].get("error") for r in results if case in r]
    assert all(e is not None for e in errors), f"{case}: expected an error on every rank, got {[r[case] for r in results]}"
    for name, _ in errors:
        assert name == "DivergenceError"
    return [message for _, message in errors]


def test_same_program_passes(results):
    assert [r["same"] for r in results] == [{"loss": results[0]["same"]["loss"]}] * 2


def test_extra_layer_on_one_rank(results):
    for message in _errors(results, "extra_layer"):
        assert "rank(s) 1 differ from rank 0" in message
        assert "parameters and buffers" in message
        # Rank 0 ends where rank 1 has the extra layer's weight.
        assert "rank 0: <nothing: ends here>" in message and "parameter 3.weight" in message


def test_other_width_on_one_rank(results):
    for message in _errors(results, "width"):
        assert "parameter 0.weight: float32[16, 8]" in message and "parameter 0.weight: float32[24, 8]" in message


def test_extra_matmul_names_the_source_line(results):
    for message in _errors(results, "extra_matmul"):
        assert "rank(s) 1 differ from rank 0 in the global graph of the step" in message
        assert "divergence_cases.py" in message and "out = out @ torch.eye(4)" in message


def test_rank_dependent_constant(results):
    """A float closure variable set from the rank: a graph input (one graph), whose values the
    per-call check compares across ranks."""
    for message in _errors(results, "scaled_loss"):
        assert "the ranks hold different values of Python floats the step reads" in message, message
        assert "closure variable scale of _scaled_step.<locals>.step: rank 0 1.0, rank 1 2.0" in message, message
    # An int is a constant of the graph: the ranks' graphs differ, at the line that reads it.
    for message in _errors(results, "scaled_loss_int"):
        assert "aten.mul.Tensor ('div', 1)" in message and "aten.mul.Tensor ('div', 2)" in message, message
        assert "loss = F.cross_entropy(model(x), y) * scale" in message


def test_rank_dependent_code_under_torch_compile(results):
    for message in _errors(results, "backend"):
        assert "rank(s) 1 differ from rank 0" in message and "out * 2.0 if rank == 1 else out" in message


def test_local_pass_that_differs_by_rank(results):
    """The local graphs' collectives are compared too, after the passes: a pass that issues other
    collectives on one rank is reported before any of them runs, not as a hang or a gloo abort."""
    for message in _errors(results, "pass"):
        assert "rank(s) 1 differ from rank 0 in the collectives of the local graph" in message
        assert "a local pass of your own (passes=[...]) that depends on the rank" in message
        assert "rank 0: <nothing: ends here>" in message or "all_reduce sum on mesh dim 0" in message


def test_missing_rank_times_out_with_its_name(results):
    (message,) = _errors(results, "missing_rank")
    assert "waited 3 s for ranks 1" in message
