"""The pipeline's process-wide settings: Python's cyclic garbage collector is off while a step
compiles (:func:`spmd_expand.pipeline.cyclic_gc_paused`; for ``torch.compile(backend="spmd")`` also
while the forward and backward graphs are lowered on their first run) and in the state the user left
it after, whether the compilation succeeds or fails. A compilation's progress goes to the
``spmd_expand`` logger."""

from __future__ import annotations

import gc
import logging
import re

import pytest
import torch
import torch.nn as nn

import spmd_expand as spmd
import spmd_expand.backend as backend
import spmd_expand.pipeline as pipeline
from cases import mse_step


def _returns_a_float(model, optimizer, x):
    return model(x).sum().item()


def _collector_seen_by(monkeypatch, module, name: str) -> list[bool]:
    """Whether the collector was on, each time ``module.name`` ran (recorded in the returned list)."""
    seen = []
    function = getattr(module, name)

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen


@pytest.fixture
def collector_seen_by_trace(monkeypatch):
    """Whether the collector was on, each time the trace (the first stage) ran."""
    return _collector_seen_by(monkeypatch, pipeline, "trace_step")


def _compile(fn, mesh):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(fn)
    return lambda: step(model, optimizer, torch.randn(2, 4))


def test_the_collector_is_off_while_compiling_and_on_again_after(fake_mesh, collector_seen_by_trace):
    assert gc.isenabled()
    _compile(mse_step, fake_mesh)()
    assert collector_seen_by_trace == [False]
    assert gc.isenabled()


def test_a_failed_compilation_turns_the_collector_on_again(fake_mesh, collector_seen_by_trace):
    with pytest.raises(spmd.SpmdError, match="return tensors"):
        _compile(_returns_a_float, fake_mesh)()
    assert collector_seen_by_trace == [False]
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(fake_mesh, collector_seen_by_trace):
    gc.disable()
    try:
        _compile(mse_step, fake_mesh)()
        assert collector_seen_by_trace == [False]
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_off_while_the_backend_lowers_its_graphs(fake_mesh, monkeypatch):
    seen = _collector_seen_by(monkeypatch, backend, "lower_graph")
    torch._dynamo.reset()
    torch.manual_seed(0)
    plan = spmd.DDP()
    model = spmd.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    compiled(torch.randn(2, 4)).square().mean().backward()
    assert seen == [False, False]  # the forward graph, then the backward graph
    assert gc.isenabled()


def _messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("spmd_expand") and r.levelno == level]


def test_a_compilation_logs_its_start_its_stages_and_its_result(fake_mesh, caplog):
    caplog.set_level(logging.DEBUG, logger="spmd_expand")
    call = _compile(mse_step, fake_mesh)
    call()
    started, finished = _messages(caplog, logging.INFO)
    assert started.startswith("compiling mse_step on cpu mesh (4,), rank 0"), started
    assert finished.startswith("compiled mse_step on cpu mesh (4,), rank 0 in "), finished
    for stage in ("trace", "propagate", "expand", "local_passes", "lower"):
        assert re.search(rf"(\(|, ){stage} \d+\.\d\d", finished), finished
    assert "lowered eager" in finished and "collectives per call: " in finished and "all_reduce" in finished
    debug = _messages(caplog, logging.DEBUG)
    begun = [m.removesuffix(" ...") for m in debug if m.endswith(" ...")]
    assert begun == ["trace", "global_passes", "rank_check", "propagate", "expand", "local_passes", "lower (eager)"]
    caplog.clear()
    call()  # the graph is reused: nothing compiles, nothing is logged
    assert _messages(caplog, logging.INFO) == [] and _messages(caplog, logging.DEBUG) == []


def test_a_compilation_is_silent_unless_logging_is_asked_for(fake_mesh, caplog):
    caplog.set_level(logging.WARNING, logger="spmd_expand")
    _compile(mse_step, fake_mesh)()
    assert [r for r in caplog.records if r.name.startswith("spmd_expand")] == []


def test_the_backend_logs_each_graph_it_compiles_and_lowers(fake_mesh, caplog):
    caplog.set_level(logging.INFO, logger="spmd_expand")
    torch._dynamo.reset()
    plan = spmd.DDP()
    model = spmd.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), fake_mesh, plan)
    compiled = torch.compile(model, backend="spmd", options={"mesh": fake_mesh, "plan": plan, "lower": "eager"})
    compiled(torch.randn(2, 4)).square().mean().backward()
    messages = _messages(caplog, logging.INFO)
    what = "a Sequential graph of torch.compile on cpu mesh (4,), rank 0"
    expected = [f"compiling {what} (", f"expanded {what} in ", f"lowered the forward graph of {what} (eager) in ",
                f"lowered the backward graph of {what} (eager) in "]
    assert len(messages) == len(expected) and all(map(str.startswith, messages, expected)), messages
