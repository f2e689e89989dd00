"""torch.nn's own layers keep the single-device promise under DDP (and a few under FSDP), or are
refused clearly; see tests/module_zoo_cases.py."""

from __future__ import annotations

import pytest
import torch

import module_zoo_cases as zoo
import torch.nn.functional as F
from spmd_expand.app.launch import run_local
from spmd_expand.forms import _embedding_bag_of_rows

FSDP = [
    "conv2d_groupnorm_pools", "conv3d_pools", "token_pool_adaptive_avg_pool1d", "transformer_encoder",
    "weight_norm_spectral_norm", "lstm", "embedding_scale_grad_by_freq", "embedding_bag_mean_padding",
    "sequence_first_lm_batch_dim_1", "custom_autograd_functions",
]


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
    _, op, fix = zoo.REFUSED[name]
    for rank, per_model in enumerate(results("ddp")):
        r = per_model[name]
        assert "refused" in r, f"rank {rank}: expected UnsupportedOpError, got {r}"
        assert op in r["refused"] and fix in r["refused"], r["refused"]


@pytest.mark.parametrize(
    "options",
    [
        dict(mode="sum"), dict(mode="mean"), dict(mode="max"), dict(mode="sum", padding_idx=0),
        dict(mode="mean", padding_idx=0), dict(mode="max", padding_idx=0), dict(mode="sum", weighted=True),
        dict(mode="sum", scale_grad_by_freq=True), dict(mode="mean", padding_idx=0, scale_grad_by_freq=True),
    ],
    ids=str,
)
def test_embedding_bag_form_matches_torch(options):
    """The form fixed-size bags are traced in (embedding, then a reduction per bag) against torch's fused
    kernel on one device: values and gradients. With ``scale_grad_by_freq`` the reference is the
    documented one (each row's gradient over the count of its index in the batch): torch 2.13's CPU
    kernel divides by another index's count (pytorch/pytorch#190063, fixed after 2.13)."""
    options = dict(options)
    torch.manual_seed(0)
    x = zoo._bags(torch.Generator().manual_seed(1))
    weights = (x.float() + 1).reciprocal() if options.pop("weighted", False) else None
    weight = torch.randn(20, 8, requires_grad=True)
    g = torch.randn(x.size(0), 8)
    ours = _embedding_bag_of_rows(x, weight, per_sample_weights=weights, **options)
    (grad,) = torch.autograd.grad(ours, weight, g)
    if options.pop("scale_grad_by_freq", False):
        ref = F.embedding_bag(x, weight, per_sample_weights=weights, **options)
        (ref_grad,) = torch.autograd.grad(ref, weight, g)
        counts = torch.bincount(x.flatten(), minlength=20).clamp(min=1)
        ref_grad = ref_grad / counts[:, None]
    else:
        ref = F.embedding_bag(x, weight, per_sample_weights=weights, **options)
        (ref_grad,) = torch.autograd.grad(ref, weight, g)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_transformer_encoder_nested_fast_path(plan):
    """One device's eval-mode TransformerEncoder with a padding mask runs on a nested tensor (padded
    positions are norm(0)); the trace cannot take that path, so it computes what the path returns.
    The evaluation step depends on the caller's grad mode (no_grad: nested path) and on torch's MHA
    fast-path switch, and is guarded on both."""
    for rank, out in enumerate(run_local(zoo.encoder_fast_path_worker, 2, plan, timeout_s=600)):
        got, want = out["distillation"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} distillation: {m}")
        torch.testing.assert_close(*out["student"], rtol=1e-5, atol=1e-6)
        for name in ("checked", "unchecked"):
            got, want, recompiles = out[name]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
            # no_grad, grad (a second graph, guarded on the grad mode), no_grad (the first graph again),
            # left padding (a graph value under the same graph), the MHA fast path off (a third graph,
            # guarded on torch.backends.mha): two recompilations, each naming its switch.
            assert len(recompiles) == 2 and "grad mode" in recompiles[0], recompiles
            assert "get_fastpath_enabled" in recompiles[1], recompiles
        # The padded positions do change the value (the test can fail): nested and regular paths differ.
        assert abs(out["checked"][1][0] - out["checked"][1][1]) > 1e-3
