"""BatchNorm under data parallelism: global-batch statistics (SyncBatchNorm semantics), running
statistics equal to one device's after every step, eval mode on the running statistics.

One spawn of 2 gloo ranks runs every config of ``batch_norm_cases.py``; each rank compares with the
single-device step over the global batch, run inside the rank. float32 configs use the design
tolerance; the float64 config checks that the statistics are exact (agreement to rounding of
float64), in a regime where float32 rounding alone would exceed the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import batch_norm_cases
import spmd_expand as spmd
from spmd_expand.app.launch import run_local

RTOL, ATOL = 1e-4, 1e-5
WORLD = 2


@pytest.fixture(scope="module")
def results():
    return run_local(batch_norm_cases.run_configs, WORLD, list(batch_norm_cases.CONFIGS), timeout_s=600)


def _ranks(results, name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
    return per_rank


def _close(actual: dict, expected: dict, what: str, rtol: float, atol: float) -> None:
    assert actual.keys() == expected.keys(), what
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def check_training(per_rank: list[dict], rtol: float = RTOL, atol: float = ATOL) -> None:
    """Losses, parameters, optimizer states and BatchNorm buffers equal the single-device run's."""
    for r in per_rank:
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=rtol, atol=atol)
        _close(r["params"], r["ref_params"], "param", rtol, atol)
        _close(r["states"], r["ref_states"], "optimizer state", rtol, atol)
        _close(r["buffers"], r["ref_buffers"], "buffer", rtol, atol)
        assert all(t == "Tensor" for t in r["buffer_types"].values()), "buffers must stay plain tensors"


def check_eval(per_rank: list[dict]) -> None:
    for r in per_rank:
        torch.testing.assert_close(r["eval_loss"], r["ref_eval_loss"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["eval_logits"], r["ref_eval_logits"], rtol=RTOL, atol=ATOL)
        # Eval mode reads the running statistics and leaves them alone.
        _close(r["eval_buffers"], r["buffers"], "buffer after eval", 0.0, 0.0)


def test_resnet10_ddp_under_inductor_matches_single_device(results):
    per_rank = _ranks(results, "resnet_ddp_inductor")
    check_training(per_rank)
    check_eval(per_rank)


def test_resnet18_ddp_matches_single_device(results):
    per_rank = _ranks(results, "resnet_ddp")
    check_training(per_rank)
    for r in per_rank:
        assert r["buffers"]["layer4.1.bn2.num_batches_tracked"].item() == 4
        assert all(p == (Replicate(),) for p in r["param_placements"].values())


def test_resnet18_ddp_eval_after_train(results):
    check_eval(_ranks(results, "resnet_ddp"))


def test_resnet18_ddp_reduces_gradients_once(results):
    """Collectives of the DDP train step: no gradient is reduced twice and no activation is gathered.
    The all-reduced bytes are at most the parameter bytes plus the BatchNorm statistics (the
    ``sync_batch_norm`` pass: per BatchNorm the float64 sums of x and x^2 forward, a float32 pair
    backward); nothing is all-gathered or reduce-scattered."""
    for r in _ranks(results, "resnet_ddp"):
        stats = r["train_collectives"]
        assert set(stats) == {"all_reduce"}, stats
        statistics_bytes = (2 * 8 + 2 * 4) * r["batch_norm_channels"]
        assert stats["all_reduce"]["bytes"] <= r["param_bytes"] + statistics_bytes, stats


def test_resnet18_fsdp_matches_single_device(results):
    per_rank = _ranks(results, "resnet_fsdp")
    check_training(per_rank, rtol=1e-9, atol=1e-11)
    for r in per_rank:
        assert all(p == (Shard(0),) for p in r["param_placements"].values()), r["param_placements"]


def test_resnet18_float64_statistics_are_exact(results):
    """8 SGD steps at lr 0.1: float64 agrees to float64 rounding, while the single-device float32 run
    of the same steps is already past the float32 tolerance from the float64 one (the drift a float32
    comparison would show here is rounding, amplified by the training dynamics)."""
    per_rank = _ranks(results, "resnet_ddp_float64")
    check_training(per_rank, rtol=1e-9, atol=1e-11)
    r = per_rank[0]
    drift = max((r["float32_params"][k].double() - r["ref_params"][k]).abs().max().item() for k in r["ref_params"])
    assert drift > ATOL, f"float32 run within {drift:.1e} of float64: the case no longer shows the rounding drift"


def test_normalization_variants_ddp(results):
    """No affine / no running statistics, a BatchNorm frozen in eval mode while training, BatchNorm1d,
    GroupNorm on a batch-sharded input; rank 1 starts from other buffers (rank 0's are broadcast)."""
    per_rank = _ranks(results, "variants_ddp")
    check_training(per_rank)
    check_eval(per_rank)
    for r in per_rank:
        torch.testing.assert_close(r["buffers"]["bn_frozen.running_mean"], r["ref_buffers"]["bn_frozen.running_mean"])
        assert r["buffers"]["bn_frozen.num_batches_tracked"].item() == 0


def test_sync_batch_norm_is_traced_as_batch_norm(results):
    """A model converted with ``SyncBatchNorm.convert_sync_batchnorm`` equals the plain-BatchNorm model
    on one device, and keeps its SyncBatchNorm modules."""
    per_rank = _ranks(results, "sync_batch_norm_ddp")
    check_training(per_rank)
    assert all(r["sync_batch_norms"] == 4 for r in per_rank)


def test_cumulative_moving_average_raises(fake_mesh):
    torch.manual_seed(0)
    model = batch_norm_cases.NormalizationVariants()
    model.bn_features.momentum = None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.DDP(), lower="eager")(batch_norm_cases.train_step)
    x, y = batch_norm_cases._batch(0, torch.float32)
    with pytest.raises(spmd.TraceError, match=r"BatchNorm1d 'bn_features' has momentum=None(.|\n)*fix: give the module a float momentum"):
        step(model, optimizer, x[:2], y[:2])
    model.bn_features.momentum = 0.1  # the fix the error names
    step(model, optimizer, x[:2], y[:2])
    assert step.last.local_graph is not None
