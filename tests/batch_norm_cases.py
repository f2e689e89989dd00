"""BatchNorm cases for ``test_batch_norm.py``: a ResNet-18-shaped CNN, a small CNN with the other
BatchNorm settings and a GroupNorm, and the worker that runs them on W ranks next to the
single-device step over the global batch (the reference), inside each rank.

Optimizer states are created up front, with the values the first ``optimizer.step()`` would create
(zeros, ``step = 0``), in both the compiled and the reference optimizer: the step then compiles once
instead of twice (first call, then steady state), which halves the time of these tests. Lazily
created states are covered by ``test_parity.py``.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import spmd_expand as spmd
from spmd_expand.app.data import shard
from spmd_expand.graph_stats import collective_stats
from spmd_expand.passes import SyncBatchNorm, default_passes

# Every training BatchNorm as all-reduced statistics: the default passes choose by cost, and these
# models' activations are small enough that the cost model keeps them fused (all-gathered), which
# test_losses, test_module_zoo and test_hf_zoo cover; here the statistics are tested.
PASSES = [SyncBatchNorm(by_cost=False), *default_passes(disable=["sync_batch_norm"])]

GLOBAL_BATCH = 8
NUM_CLASSES = 10


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-bn, a 1x1 conv-bn shortcut where the shape changes."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + identity)


class ResNet18(nn.Module):
    """ResNet-18's layout (He et al. 2016; torchvision's ``resnet18``) at narrow widths for small inputs.

    conv-bn-relu stem (3x3, stride 1: the input is 3x16x16), 4 stages of ``blocks_per_stage``
    BasicBlocks (widths ``widths``, stride 2 and a downsample shortcut from the second stage on),
    adaptive average pool, fc. 20 BatchNorm2d modules (12 with one block a stage: ResNet-10's layout).
    Input ``(N, 3, H, W)``, output ``(N, num_classes)``.
    """

    def __init__(
        self, widths: tuple[int, ...] = (8, 16, 32, 64), num_classes: int = NUM_CLASSES, blocks_per_stage: int = 2
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        stages, in_channels = [], widths[0]
        for i, width in enumerate(widths):
            blocks = [BasicBlock(in_channels, width, 1 if i == 0 else 2)]
            blocks += [BasicBlock(width, width, 1) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet10() -> ResNet18:
    """ResNet-18's layout with one BasicBlock a stage: every kind of BatchNorm use (stem, block,
    downsample shortcut) with 12 BatchNorms instead of 20: fewer kernels for Inductor to compile."""
    return ResNet18(blocks_per_stage=1)


class NormalizationVariants(nn.Module):
    """The other BatchNorm settings in one small CNN, and a GroupNorm.

    ``gn``: GroupNorm on the batch-sharded activation (its kernels take N, C, HxW as ints, which must
    be each rank's own); ``bn``: default BatchNorm2d; ``bn_stateless``: no affine and no running
    statistics (batch statistics in train and eval); ``bn_frozen``: a BatchNorm2d kept in eval mode
    while the model trains (running statistics used, not updated; gradients still flow);
    ``bn_features``: BatchNorm1d on ``(N, C)`` features with momentum 0.3.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn_stateless = nn.BatchNorm2d(8, affine=False, track_running_stats=False)
        self.bn_frozen = nn.BatchNorm2d(8)
        self.bn_features = nn.BatchNorm1d(8, momentum=0.3)
        self.fc = nn.Linear(8, NUM_CLASSES)
        with torch.no_grad():
            self.bn_frozen.running_mean.normal_(0.0, 0.1)
            self.bn_frozen.running_var.uniform_(0.5, 1.5)
        self.train()

    def train(self, mode: bool = True) -> "NormalizationVariants":
        super().train(mode)
        self.bn_frozen.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.gn(self.conv0(x)))
        h = F.relu(self.bn(self.conv1(h)))
        h = F.relu(self.bn_frozen(self.bn_stateless(self.conv2(h))))
        return self.fc(F.relu(self.bn_features(h.mean((2, 3)))))


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def eval_step(model, x, y):
    """Loss and logits of a model in eval mode: forward only, no backward, no update."""
    logits = model(x)
    return F.cross_entropy(logits, y), logits


def _sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _adamw_fused(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)


def _create_states(optimizer: torch.optim.Optimizer) -> None:
    """The states the first step would create, with the same values (SGD momentum, Adam moments)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(optimizer, torch.optim.SGD):
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
            else:
                optimizer.state[p].update(
                    step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                )


@dataclass
class Config:
    model: Callable[[], nn.Module]
    plan: Callable[[], object]
    optimizer: Callable
    lr: float
    steps: int
    dtype: torch.dtype = torch.float32
    evaluate: bool = False
    # The compiled model's own form of the reference model (e.g. its SyncBatchNorm conversion).
    convert: Optional[Callable[[nn.Module], nn.Module]] = None
    # Also run the single-device step in float32 from the same start (how far rounding alone moves it).
    float32_reference: bool = False
    # Ranks other than 0 start from other running statistics: the first call takes rank 0's (as DDP
    # broadcasts buffers at construction), so every rank equals the single-device run from rank 0's.
    other_buffers_off_rank0: bool = False
    lower: str = "eager"


CONFIGS: dict[str, Config] = {
    # SGD at lr 0.02 keeps a batch-8 ResNet in a regime where float32 runs are reproducible.
    "resnet_ddp": Config(ResNet18, spmd.DDP, _sgd, lr=0.02, steps=4, evaluate=True),
    # fused AdamW computes its bias corrections in double, in the kernel, as eager does. lr 1e-3: Adam
    # moves an element whose gradient is near eps by a fraction of lr set by the gradient's last bits
    # (any change of reduction order does it); at lr 1e-2 one of 36,864 elements of layer4.1.conv2
    # landed 1.24e-5 away in some runs, past atol 1e-5.
    # The default lowering: Inductor stopped on a ResNet's BatchNorm under DDP (size-generic kernels,
    # and a symbolic unbiased-variance factor torch's tensorify pass could not place). ResNet-10: Inductor's
    # compilation of ResNet-18 was ~2/3 of this module's time on 2 cores.
    "resnet_ddp_inductor": Config(resnet10, spmd.DDP, _sgd, lr=0.02, steps=4, evaluate=True, lower="inductor"),
    # float64: AdamW turns a gradient that is zero up to float32 rounding into a step of a fraction of lr
    # (layer4.1.conv2.weight[26, 4, 2, 1] at step 0: -3.8e-8 in float32, -6.0e-8 in float64, median
    # |grad| 8e-3), so any change of summation order (the BatchNorm statistics as sums over the ranks'
    # rows) moved that element by ~8e-5 in float32: the single-device float32 run is itself 6.6e-5 from
    # the float64 one there. In float64 the comparison checks the arithmetic, to float64 rounding.
    "resnet_fsdp": Config(ResNet18, spmd.FSDP, _adamw_fused, lr=1e-3, steps=4, dtype=torch.float64),
    # lr 0.1 at batch 8 is chaotic: float32 rounding alone moves the single-device run past the
    # tolerance within 8 steps, so exactness of the statistics is checked in float64.
    "resnet_ddp_float64": Config(ResNet18, spmd.DDP, _sgd, lr=0.1, steps=8, dtype=torch.float64, float32_reference=True),
    "variants_ddp": Config(NormalizationVariants, spmd.DDP, _sgd, lr=0.05, steps=3, evaluate=True, other_buffers_off_rank0=True),
    "sync_batch_norm_ddp": Config(
        NormalizationVariants, spmd.DDP, _sgd, lr=0.05, steps=3, convert=nn.SyncBatchNorm.convert_sync_batchnorm
    ),
}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g).to(dtype)
    return x, torch.randint(0, NUM_CLASSES, (GLOBAL_BATCH,), generator=g)


def _states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{fqn}.{key}": _full(v).detach().clone()
        for fqn, p in model.named_parameters()
        for key, v in optimizer.state[p].items()
        if isinstance(v, torch.Tensor)
    }


def _single_device_run(cfg: Config, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model).to(dtype)
    optimizer = cfg.optimizer(model.parameters(), cfg.lr)
    _create_states(optimizer)
    for i in range(cfg.steps):
        train_step(model, optimizer, *_batch(i, dtype))
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run_config(cfg: Config, rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = cfg.model().to(cfg.dtype)
    model = copy.deepcopy(reference)
    if cfg.convert is not None:
        model = cfg.convert(model)
    if cfg.other_buffers_off_rank0 and rank != 0:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if b.is_floating_point():
                    b.add_(0.5 * rank)
    optimizer, ref_optimizer = cfg.optimizer(model.parameters(), cfg.lr), cfg.optimizer(reference.parameters(), cfg.lr)
    _create_states(optimizer)
    _create_states(ref_optimizer)
    step = spmd.compile(mesh=mesh, plan=cfg.plan(), lower=cfg.lower, passes=PASSES)(train_step)
    float32_params = _single_device_run(cfg, reference, torch.float32) if cfg.float32_reference else None
    losses, ref_losses = [], []
    for i in range(cfg.steps):
        x, y = _batch(i, cfg.dtype)
        ref_losses.append(train_step(reference, ref_optimizer, x, y).detach())
        losses.append(step(model, optimizer, shard(x, rank, world), shard(y, rank, world)).detach())
    result = {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": {k: _full(v).detach().clone() for k, v in model.named_parameters()},
        "ref_params": {k: v.detach().clone() for k, v in reference.named_parameters()},
        "states": _states(model, optimizer),
        "ref_states": _states(reference, ref_optimizer),
        "buffers": {k: b.clone() for k, b in model.named_buffers()},
        "ref_buffers": {k: b.clone() for k, b in reference.named_buffers()},
        "param_placements": {k: tuple(v.placements) for k, v in model.named_parameters()},
        "buffer_types": {k: type(b).__name__ for k, b in model.named_buffers()},
        "sync_batch_norms": sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()),
        "train_collectives": collective_stats(step.last.local_graph).as_dict(),
        "param_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "batch_norm_channels": sum(m.num_features for m in reference.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)),
    }
    if float32_params is not None:
        result["float32_params"] = float32_params
    if cfg.evaluate:
        model.eval()
        reference.eval()
        x, y = _batch(cfg.steps, cfg.dtype)
        # A separate compiled step: the train-mode graph is not reused for eval mode.
        evaluate = spmd.compile(mesh=mesh, plan=cfg.plan(), lower=cfg.lower)(eval_step)
        loss, logits = evaluate(model, shard(x, rank, world), shard(y, rank, world))
        ref_loss, ref_logits = eval_step(reference, x, y)
        result.update(
            eval_loss=loss.detach(), ref_eval_loss=ref_loss.detach(),
            eval_logits=logits.detach(), ref_eval_logits=ref_logits.detach(),
            eval_buffers={k: b.clone() for k, b in model.named_buffers()},
            eval_collectives=collective_stats(evaluate.last.local_graph).as_dict(),
        )
    return result


def run_configs(rank: int, world: int, names: list[str]) -> dict:
    """Worker: run each named config on this rank; errors are returned per config, not raised."""
    results = {}
    for name in names:
        try:
            results[name] = run_config(CONFIGS[name], rank, world)
        except Exception:  # noqa: BLE001 - reported per config by the test
            results[name] = {"error": traceback.format_exc()}
    return results
