"""Eager-style gradient accumulation: one call per micro-batch, gradient sync off until the last."""

from __future__ import annotations

import pytest
import torch

import cases
from spmd_expand.app.launch import run_local


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_no_sync_accumulates_then_reduces_once(plan):
    r = run_local(cases.run_no_sync, 2, plan, timeout_s=600)[0]
    for k in r["ref_params"]:
        torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=1e-4, atol=1e-5)
    # Between the calls the accumulated gradients are unreduced (Partial) DTensors ...
    assert set(r["grads_between"][0].values()) == {"DTensor(Partial(sum),)"}
    # ... the accumulating call reduces no gradient (only the scalar loss terms it returns) ...
    acc = r["accumulate_collectives"]
    assert "reduce_scatter" not in acc and acc["all_reduce"]["count"] == 2 and acc["all_reduce"]["bytes"] == 8
    # ... the updating call reduces each gradient once, and zero_grad() leaves .grad None.
    upd = r["update_collectives"]
    if plan == "ddp":
        assert upd["all_reduce"]["count"] == 4 + 2
    else:
        assert upd["reduce_scatter"]["count"] == 4
    assert all(r["grads_after"])
