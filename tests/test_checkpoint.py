"""Training state as DTensors works with torch.distributed.checkpoint (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import cases
import checkpoint_workers as w
from spmd_expand.app.launch import run_local


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "fsdp_w2")
    return path, run_local(w.train_and_save, 2, path, "fsdp", timeout_s=600)


def test_full_state_dict_on_cpu_is_plain_and_complete(saved):
    _, results = saved
    r = results[0]
    assert r["full_model_is_plain"]
    model = cases.CASES["mlp_uneven"].model()
    assert {k: tuple(v.shape) for k, v in r["full_model"].items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert r["full_optim_keys"] == sorted(k for k, _ in model.named_parameters())
    # As torch documents for cpu_offload=True: full tensors on rank 0, nothing on the others.
    assert results[1]["full_model"] == {}


@pytest.mark.parametrize(
    "world,plan",
    [(2, "fsdp"), (1, "fsdp"), (1, "ddp"), (2, "ddp")],
    ids=["fsdp_w2", "fsdp_w1", "ddp_w1", "ddp_w2"],
)
def test_resume_matches_uninterrupted_run(saved, world, plan):
    path, results = saved
    resumed = run_local(w.load_and_continue, world, path, plan, timeout_s=600)[0]
    torch.testing.assert_close(
        torch.tensor(resumed["losses_after"]), torch.tensor(results[0]["losses_after"]), rtol=1e-4, atol=1e-5
    )


def test_load_full_state_dict_before_first_call(saved):
    _, results = saved
    full = results[0]["full_model"]
    out = run_local(w.load_full_before_first_call, 2, full, timeout_s=600)
    # The loaded weights are what the first step starts from: same loss as the reference model
    # loaded with the same weights on one device.
    model = cases.CASES["mlp_uneven"].model()
    model.load_state_dict(full)
    optimizer = cases.OPTIMIZERS["adamw_foreach"](model.parameters())
    batch = cases.CASES["mlp_uneven"].batch(torch.Generator().manual_seed(100))
    ref_loss = float(cases.cross_entropy_step(model, optimizer, *batch))
    assert out[0]["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    for k, v in model.named_parameters():
        torch.testing.assert_close(out[0]["params"][k], v.detach(), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "fsdp_tp_2x2")
    return path, run_local(w.train_and_save, 4, path, "fsdp+tp", timeout_s=600)


@pytest.mark.parametrize("world,plan", [(4, "fsdp+tp"), (2, "fsdp"), (1, "ddp")], ids=["fsdp+tp_2x2", "fsdp_w2", "ddp_w1"])
def test_2d_checkpoint_resumes_under_any_plan(saved_2d, world, plan):
    path, results = saved_2d
    resumed = run_local(w.load_and_continue, world, path, plan, timeout_s=600)[0]
    torch.testing.assert_close(
        torch.tensor(resumed["losses_after"]), torch.tensor(results[0]["losses_after"]), rtol=1e-4, atol=1e-5
    )
