"""Mixed precision (``MixedPrecisionPolicy``) on real ranks, against torch's own FSDP2 on one device.

The reference is ``fully_shard`` with the same policy on a one-rank group, run over the global batch:
torch's implementation of the semantics the plan promises (fp32 parameters and optimizer states,
compute in ``param_dtype``, gradients cast to ``reduce_dtype`` and back), with nothing of ours in it.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import spmd_expand as spmd
from spmd_expand.app.models import MLP, GPTConfig, build_gpt, language_model_step
from spmd_expand.graph_stats import collective_stats

BF16 = torch.bfloat16
POLICIES = {
    # FSDP2's common recipe: bf16 compute and all-gathers, fp32 gradient reduction.
    "bf16_fp32": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32),
    # reduce_dtype defaults to param_dtype: both directions move bf16.
    "bf16": MixedPrecisionPolicy(param_dtype=BF16),
    # DDP's bf16_compress_hook: fp32 compute, bf16 gradient all-reduce.
    "reduce_bf16": MixedPrecisionPolicy(reduce_dtype=BF16),
    # Root output cast back to fp32 (the loss is computed in fp32 from bf16 activations).
    "bf16_out_fp32": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32),
}
STEPS = 3


def _gpt():
    return build_gpt(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=96))


def _gpt_checkpointed():
    """The GPT with every block under torch.utils.checkpoint (FSDP2's usual bf16 + checkpointing recipe)."""
    return build_gpt(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=96, activation_checkpointing="full"))


def _mlp():
    return MLP(16, 64, 8, activation=nn.GELU)


def mse_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mse_microbatch_step(model, optimizer, x, y):
    """Two backward calls before the update: each reduces its gradient (as FSDP2 does)."""
    total = 0.0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        loss = F.mse_loss(model(xs).float(), ys) / 2
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total


def autocast_step(model, optimizer, idx, targets):
    """The user's own mixed precision: torch.autocast around forward and loss (no policy)."""
    with torch.autocast("cpu", dtype=BF16):
        loss = model(idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _hf_llama():
    import hf_zoo

    return hf_zoo.ZOO["llama"].build()


def _hf_lm_step(model, optimizer, input_ids, labels):
    import hf_zoo

    return hf_zoo.lm_step(model, optimizer, input_ids, labels)


def _hf_batch(g):
    import hf_zoo

    return list(hf_zoo.causal_batch(g))


MODELS = {
    "gpt": (_gpt, language_model_step, lambda g: [torch.randint(0, 96, (8, 32), generator=g)] * 2),
    "gpt_checkpointed": (_gpt_checkpointed, language_model_step, lambda g: [torch.randint(0, 96, (8, 32), generator=g)] * 2),
    "gpt_autocast": (_gpt, autocast_step, lambda g: [torch.randint(0, 96, (8, 32), generator=g)] * 2),
    "hf_llama": (_hf_llama, _hf_lm_step, _hf_batch),
    "mlp": (_mlp, mse_step, lambda g: [torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)]),
    "mlp_microbatch": (_mlp, mse_microbatch_step, lambda g: [torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)]),
}

# AdamW for the transformer (its update hides a gradient's scale; the loss and SGD cases see it).
_ADAMW = lambda ps: torch.optim.AdamW(ps, lr=LR_ADAMW, weight_decay=0.1, foreach=True)  # noqa: E731
_SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
LR_ADAMW = 1e-3
OPTIMIZERS = {"hf_llama": _ADAMW, "gpt": _ADAMW, "gpt_checkpointed": _ADAMW, "gpt_autocast": _ADAMW, "mlp": _SGD, "mlp_microbatch": _SGD}

# name -> (model, plan, policy (None: the step's own autocast, checked against eager), lower)
CASES = {
    "gpt_checkpointed_fsdp_bf16_fp32": ("gpt_checkpointed", "fsdp", "bf16_fp32", "eager"),
    "gpt_ddp_reduce_bf16": ("gpt", "ddp", "reduce_bf16", "eager"),
    "hf_llama_fsdp_bf16_fp32": ("hf_llama", "fsdp", "bf16_fp32", "eager"),
    "mlp_fsdp_bf16_out_fp32": ("mlp", "fsdp", "bf16_out_fp32", "inductor"),
    "mlp_microbatch_fsdp_bf16": ("mlp_microbatch", "fsdp", "bf16", "eager"),
    "gpt_fsdp_autocast": ("gpt_autocast", "fsdp", None, "eager"),
}


def _reference_mesh(rank: int, world: int) -> DeviceMesh:
    """A one-rank mesh for this rank (every rank creates every group, in the same order)."""
    groups = [dist.new_group([r]) for r in range(world)]
    return DeviceMesh.from_group(groups[rank], "cpu")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_case(name: str, mesh, reference_mesh, world: int) -> dict:
    model_name, plan_name, policy_name, lower = CASES[name]
    build, step_fn, batch = MODELS[model_name]
    policy = POLICIES[policy_name] if policy_name else None
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    if policy is not None:
        fully_shard(reference, mesh=reference_mesh, mp_policy=policy)
    plan = spmd.FSDP(mp_policy=policy) if plan_name == "fsdp" else spmd.DDP(mp_policy=policy)
    step = spmd.compile(mesh=mesh, plan=plan, lower=lower)(step_fn)
    optimizer, ref_optimizer = OPTIMIZERS[model_name](model.parameters()), OPTIMIZERS[model_name](reference.parameters())
    rank = dist.get_rank()
    losses, ref_losses = [], []
    for i in range(STEPS):
        tensors = batch(torch.Generator().manual_seed(100 + i))
        ref_losses.append(step_fn(reference, ref_optimizer, *tensors).detach().float())
        local = [t.chunk(world)[rank] for t in tensors]
        losses.append(step(model, optimizer, *local).detach())
    stats = collective_stats(step.last.local_graph)
    return {
        "losses": torch.stack([x.float() for x in losses]),
        "loss_dtype": losses[0].dtype,
        "ref_losses": torch.stack(ref_losses),
        "params": {k: _full(v) for k, v in model.named_parameters()},
        "ref_params": {k: _full(v) for k, v in reference.named_parameters()},
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state_dtypes": sorted({str(t.dtype) for st in optimizer.state.values() for t in st.values() if t.dim()}),
        "bytes": dict(stats.bytes),
        "counts": dict(stats.count),
        "mm_dtypes": sorted(
            {
                str(n.meta["val"].dtype)
                for n in step.last.local_graph.graph.nodes
                if n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            }
        ),
    }


def run_cases(rank: int, world: int, names: list[str]) -> dict:
    """Worker: each named case on this rank; errors are returned per case, not raised."""
    import traceback

    mesh = init_device_mesh("cpu", (world,))
    reference_mesh = _reference_mesh(rank, world)
    results = {}
    for name in names:
        try:
            results[name] = run_case(name, mesh, reference_mesh, world)
        except Exception:  # noqa: BLE001 - reported per case by the test
            results[name] = {"error": traceback.format_exc()}
    return results
