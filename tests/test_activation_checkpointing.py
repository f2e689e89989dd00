"""Activation checkpointing inside the model is honoured: the local graph recomputes in backward.

``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (full), selective checkpointing
(``create_selective_checkpoint_contexts`` with an op list or a policy function) and the reentrant
variant are traced as one device runs them: the ops a mode does not save appear again inside
backward, and FSDP's recompute reads the parameters it gathers again for backward (no gather of
activations). Parity on 2 real gloo ranks under DDP and FSDP against the single-device run over the
global batch; the graph checks read the ranks' own local graphs.
"""

from __future__ import annotations

import re

import pytest
import torch

import activation_checkpointing_cases as cases
import spmd_expand as spmd
from spmd_expand.app.launch import run_local

RTOL, ATOL = 1e-4, 1e-5
# Selective checkpointing is placed the same way under DDP as under FSDP; FSDP covers it.
CASES = [("ddp", "full"), ("ddp", "reentrant"),
         ("fsdp", "none"), ("fsdp", "full"), ("fsdp", "selective"), ("fsdp", "policy"),
         ("fsdp", "dropout_saved")]

# Ops of the 2 checkpointed blocks that backward runs again, per mode (none: backward recomputes
# nothing). One addmm a block: backward needs fc1's output, not fc2's (the non-reentrant recompute
# stops early; the reentrant one's fc2 output has no user and is dead code).
RECOMPUTED = {
    "none": {"gelu": 0, "addmm": 0, "native_layer_norm": 0},
    "full": {"gelu": 2, "addmm": 2, "native_layer_norm": 2},
    "selective": {"gelu": 2, "addmm": 0, "native_layer_norm": 2},  # matmuls saved
    "policy": {"gelu": 0, "addmm": 2, "native_layer_norm": 2},  # GELU saved
    "reentrant": {"gelu": 2, "addmm": 2, "native_layer_norm": 2},
    "dropout_saved": {"gelu": 2, "addmm": 2, "native_layer_norm": 2, "native_dropout": 0},
}


@pytest.fixture(scope="module")
def results():
    return run_local(cases.run_parity, 2, CASES, timeout_s=600)


def _case(results, plan, mode) -> list[dict]:
    for rank, per_rank in enumerate(results):
        assert "error" not in per_rank[plan, mode], f"rank {rank} failed:\n{per_rank[plan, mode]['error']}"
    return [per_rank[plan, mode] for per_rank in results]


@pytest.mark.parametrize("plan,mode", CASES)
def test_parity(results, plan, mode):
    for r in _case(results, plan, mode):
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL)
        assert r["params"].keys() == r["ref_params"].keys()
        for k in r["ref_params"]:
            torch.testing.assert_close(r["params"][k], r["ref_params"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("plan,mode", CASES)
def test_backward_recomputes(results, plan, mode):
    r = _case(results, plan, mode)[0]
    in_backward = r["in_backward"]
    assert r["recompute_after_forward"], "a pass moved recomputed ops into forward"
    assert {op: in_backward.get(f"aten.{op}.default", 0) for op in RECOMPUTED[mode]} == RECOMPUTED[mode]


@pytest.mark.parametrize("mode", ["full", "selective", "policy"])
def test_fsdp_recompute_gathers_parameters_not_activations(results, mode):
    # The recompute reads each parameter through its unshard, gathered again for backward in its
    # block's bucket: not one collective more than without checkpointing.
    assert _case(results, "fsdp", mode)[0]["collectives"] == _case(results, "fsdp", "none")[0]["collectives"]


def test_recomputed_dropout_is_refused(fake_mesh):
    """A random op that checkpointing would re-run in backward is refused, naming the fix (saving
    its output, as ``dropout_saved`` does, keeps parity): the generator state that checkpoint
    restores before recomputing is not part of a traced graph, so the mask would differ."""
    model = cases.Net("full", dropout=0.5)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(cases.step)
    x, y = cases.batches(1)[0]
    with pytest.raises(spmd.TraceError, match=r"(?s)aten.native_dropout.default.*create_selective_checkpoint_contexts"):
        step(model, torch.optim.AdamW(model.parameters()), x[:2], y[:2])


def test_inductor_keeps_the_recompute(fake_mesh):
    """Inductor does not fold the recomputed matmuls back into the forward's (no CSE across them)."""
    from torch._inductor.utils import run_and_get_code

    addmms = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = cases.Net(mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="inductor")(cases.step)
        x, y = cases.batches(1)[0]
        rows = cases.BATCH // fake_mesh.size()
        _, code = run_and_get_code(step, model, optimizer, x[:rows], y[:rows])
        addmms[mode] = len(re.findall(r"extern_kernels\.addmm\(", "\n".join(code)))
    assert addmms["full"] == addmms["none"] + 2, addmms
