"""Issue 13: meta-device initialization, FSDP on chosen submodules (DDP for the rest), CPU offload.

Parity runs on 2 real gloo ranks (workers in ``meta_init_cases.py``); graph and plan checks run
in-process on the fake process group (W=4).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import meta_init_cases
import spmd_expand as spmd
from cases import GPT_CONFIG
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import GPT, build_gpt, language_model_step
from spmd_expand.graph_stats import collective_stats
from spmd_expand.passes.bucketing import collective_kind
from spmd_expand.plans import resolve_plan

RTOL, ATOL = 1e-4, 1e-5
RUNS = [
    ("compile", "fsdp"),
    ("compile", "ddp"),
    ("compile", "fsdp_blocks"),
    ("compile_dcp", "fsdp"),
    ("torch_compile", "fsdp"),
    ("random_init", "ddp"),
    ("replicated_broadcast_compile", "fsdp_0"),
    ("replicated_broadcast_torch_compile", "fsdp_0"),
]
BLOCK = "layers."


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_local(meta_init_cases.run, 2, RUNS, str(tmp_path_factory.mktemp("checkpoints")), timeout_s=600)


def _ok(per_rank, run):
    for rank, res in enumerate(per_rank):
        assert "error" not in res[run], f"rank {rank} failed:\n{res[run]['error']}"
    return [res[run] for res in per_rank]


def _expected_placement(plan_name, fqn, shape):
    sharded = plan_name == "fsdp" or (plan_name == "fsdp_blocks" and fqn.startswith(BLOCK))
    return (Shard(0),) if sharded and len(shape) else (Replicate(),)


@pytest.mark.parametrize("run", [r for r in RUNS if r[0] in ("compile", "compile_dcp", "torch_compile")], ids="-".join)
def test_meta_model_loaded_into_shards_trains_like_one_device(results, run):
    path, plan_name = run
    per_rank = _ok(results, run)
    for rank, r in enumerate(per_rank):
        # Before to_empty: meta DTensors of this rank's local shape, with the plan's placements.
        for fqn, (kind, device, local_device, local_shape, global_shape, placements) in r["meta"].items():
            assert (kind, device, local_device) == ("DTensor", "meta", "meta"), fqn
            assert placements == _expected_placement(plan_name, fqn, global_shape), fqn
            if placements == (Shard(0),):
                assert local_shape == (torch.empty(global_shape[0]).chunk(2)[rank].shape[0], *global_shape[1:]), fqn
            else:
                assert local_shape == global_shape, fqn
        for fqn, p in r["params"].items():
            torch.testing.assert_close(p, r["ref_params"][fqn], rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} {fqn}: {m}")
    if path.startswith("compile"):  # the step returns the global loss
        for r in per_rank:
            torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL)
    else:  # the user's loss over this rank's rows: the ranks' mean is the global loss
        mean = sum(r["losses"] for r in per_rank) / len(per_rank)
        torch.testing.assert_close(mean, per_rank[0]["ref_losses"], rtol=RTOL, atol=ATOL)


def test_random_init_on_a_cpu_mesh_is_rank_local(results):
    """DTensor has no RNG tracker on CPU: init ops draw from each rank's own generator. Replicated
    parameters agree when every rank seeds alike and draws alike; every rank's shard of a Shard(0)
    parameter holds the same values (the first rows of a single-device draw), not a slice of one
    tensor. Hence the README: on CPU meshes, load a checkpoint or a full state dict."""
    per_rank = _ok(results, ("random_init", "ddp"))
    for name in ("weight", "bias"):
        torch.testing.assert_close(per_rank[0]["replicated"][name], per_rank[1]["replicated"][name], rtol=0, atol=0)
    torch.testing.assert_close(per_rank[0]["sharded"]["weight"], per_rank[1]["sharded"]["weight"], rtol=0, atol=0)


@pytest.mark.parametrize("path", ["compile", "torch_compile"])
def test_replicated_parameters_are_broadcast_before_the_first_step(results, path):
    per_rank = _ok(results, (f"replicated_broadcast_{path}", "fsdp_0"))
    # Random init after uneven shards: the replicated layer differs across ranks ...
    assert not torch.equal(per_rank[0]["before"]["weight"], per_rank[1]["before"]["weight"])
    # ... until the first step (or compilation) broadcasts rank 0's values.
    for name, value in per_rank[0]["before"].items():
        for rank, r in enumerate(per_rank):
            torch.testing.assert_close(r["after"][name], value, rtol=0, atol=0, msg=lambda m: f"rank {rank} {name}: {m}")


# ---------------------------------------------------------------------------------- in-process checks


def test_meta_model_before_to_empty_is_refused(fake_mesh):
    with torch.device("meta"):
        model = GPT(GPT_CONFIG)
    step = spmd.compile(mesh=fake_mesh, plan=spmd.FSDP(), lower="eager")(language_model_step)
    step.prepare(model)
    assert all(isinstance(p, DTensor) and p.is_meta for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(spmd.TraceError, match=r"meta device.*to_empty"):
        step(model, optimizer, idx, idx)


def _gpt_blocks_step(mesh, passes):
    model = build_gpt(GPT_CONFIG, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = spmd.compile(mesh=mesh, plan=spmd.FSDP(modules=["layers.*"]), lower="eager", passes=passes)(language_model_step)
    idx = torch.randint(0, GPT_CONFIG.vocab_size, (2, 8))
    for _ in range(2):  # the second call is the steady-state graph (optimizer state exists)
        step(model, optimizer, idx, idx)
    return step, model


def test_fsdp_on_blocks_gathers_and_reduce_scatters_blocks_and_all_reduces_the_rest(fake_mesh):
    step, model = _gpt_blocks_step(fake_mesh, passes=["regather_for_backward"])
    kinds: dict[str, set] = {}
    for node in step.last.local_graph.graph.nodes:
        kind, fqn = collective_kind(node), node.meta.get("fqn")
        if kind and fqn:
            kinds.setdefault(fqn, set()).add(kind)
    params = dict(model.named_parameters())
    for fqn, p in params.items():
        if fqn.startswith(BLOCK):
            assert p.placements == (Shard(0),), fqn
            assert kinds[fqn] == {"all_gather", "reduce_scatter"}, fqn
        else:
            assert p.placements == (Replicate(),), fqn
            assert kinds[fqn] == {"all_reduce"}, fqn  # tok_emb.weight (tied head), pos_emb, ln_f
    assert {f for f in kinds if not f.startswith(BLOCK)} == {f for f in params if not f.startswith(BLOCK)}


def test_fsdp_on_blocks_buckets_per_kind(fake_mesh):
    step, _ = _gpt_blocks_step(fake_mesh, passes="default")
    counts = collective_stats(step.last.local_graph).count
    # Per block (2): one all-gather in forward, one in backward, one reduce-scatter. The replicated
    # parameters' gradients and the returned loss: one all-reduce bucket; the loss denominator its own.
    assert counts["all_gather"] == 4, counts
    assert counts["reduce_scatter"] == 2, counts
    assert counts["all_reduce"] == 2, counts


def test_fsdp_modules_glob_matching_nothing_is_refused(fake_mesh):
    with pytest.raises(spmd.PlanError, match=r"'blocks\.\*' matches no submodule"):
        resolve_plan(spmd.FSDP(modules=["blocks.*"]), fake_mesh, build_gpt(GPT_CONFIG))


def test_fsdp_modules_shards_descendants_and_tied_parameters(fake_mesh):
    model = build_gpt(GPT_CONFIG)
    resolved = resolve_plan(spmd.FSDP(modules="head"), fake_mesh, model)
    placements = {fqn: resolved.param_placements(fqn, p) for fqn, p in model.named_parameters()}
    assert placements["tok_emb.weight"] == (Shard(0),)  # tied to head.weight, which the glob names
    assert {pl for fqn, pl in placements.items() if fqn != "tok_emb.weight"} == {(Replicate(),)}
    resolved = resolve_plan(spmd.FSDP(modules=["layers.0"]), fake_mesh, model)
    assert resolved.param_placements("layers.0.attn.q_proj.weight", model.layers[0].attn.q_proj.weight) == (Shard(0),)
    assert resolved.param_placements("layers.1.attn.q_proj.weight", model.layers[1].attn.q_proj.weight) == (Replicate(),)


@pytest.mark.parametrize("policy", [CPUOffloadPolicy(), CPUOffloadPolicy(pin_memory=False), OffloadPolicy()])
def test_cpu_offload_on_a_cpu_mesh_is_accepted_and_changes_nothing(fake_mesh, policy):
    model = build_gpt(GPT_CONFIG)
    with_policy = resolve_plan(spmd.FSDP(offload_policy=policy), fake_mesh, model)
    without = resolve_plan(spmd.FSDP(), fake_mesh, model)
    for fqn, p in model.named_parameters():
        assert with_policy.param_placements(fqn, p) == without.param_placements(fqn, p)


def test_cpu_offload_on_a_device_mesh_is_refused():
    # No GPU needed: resolve_plan calls check_mesh, which reads only the mesh's device type (a
    # DeviceMesh's is a read-only property, and a CUDA mesh cannot be built without a GPU).
    cuda_mesh = SimpleNamespace(device_type="cuda")
    with pytest.raises(spmd.PlanError, match=r"CPU offload is not implemented for device meshes on 'cuda' yet; drop the offload_policy"):
        spmd.FSDP(offload_policy=CPUOffloadPolicy()).check_mesh(cuda_mesh)
    spmd.FSDP(offload_policy=OffloadPolicy()).check_mesh(cuda_mesh)  # torch's "no offload"


def test_offload_policy_of_another_type_is_refused(fake_mesh):
    with pytest.raises(spmd.PlanError, match="OffloadPolicy"):
        resolve_plan(spmd.FSDP(offload_policy="cpu"), fake_mesh, build_gpt(GPT_CONFIG))


def test_cross_rank_state_check_tells_meta_from_materialized():
    # A rank on meta skips the broadcast the others enter: the structural check must differ.
    from spmd_expand.rank_check import state_entries

    with torch.device("meta"):
        meta = torch.nn.Linear(4, 2)
    plain = torch.nn.Linear(4, 2)
    placements = lambda fqn, p: (Replicate(),)  # noqa: E731
    meta_entries, _ = state_entries(meta, placements)
    assert meta_entries != state_entries(plain, placements)[0]
    assert all(" meta " in e for e in meta_entries)
