"""A ResNet-shaped CNN with BatchNorm under DDP: communication and step time, with and without the
``sync_batch_norm`` pass, against torch DDP, on 2 gloo ranks.

Every variant trains the same CNN (ResNet-18's layout: a 3x3 stem and four stages of two basic blocks,
widths ``--width`` x 1, 2, 4, 8, BatchNorm after every convolution; same seed) with SGD (momentum 0.9)
on the same global batch split over 2 local CPU ranks (one intra-op thread each):

* ``spmd_ddp``: ``spmd.compile`` with ``spmd.DDP()`` and the default passes (``sync_batch_norm``
  among them, choosing per BatchNorm by cost: the statistics' all-reduces for large activations,
  the gathered activations for small ones);
* ``spmd_ddp_statistics``: the same with ``SyncBatchNorm(by_cost=False)``: every BatchNorm as
  per-channel sums (per BatchNorm two all-reduces: the float64 sums of ``x`` and ``x^2``, the
  backward's pair);
* ``spmd_ddp_no_sync_batch_norm``: the same without that pass (DTensor's batch-norm strategies: each
  BatchNorm's input all-gathered, forward and backward);
* ``torch_ddp``: ``DistributedDataParallel`` eager with plain BatchNorm, which normalizes with each
  rank's own statistics: not one device's results (the spmd variants' are), but the speed a DDP
  user gets. (``nn.SyncBatchNorm``, eager's way to global statistics, runs on GPUs only: DDP refuses
  it on CPU modules);
* ``local_floor``: one process over the *local* batch with plain BatchNorm, no communication: the
  compute floor.

``--lower`` picks the spmd lowering (default ``eager``: Inductor takes minutes on 2 cores for this
model). After warm-up, ``--rounds`` rounds run one step of every variant each, interleaved after a
barrier; times are medians (p10/p90) of rank 0's wall time per step. Prints one JSON object: per
variant the times, the ratio to ``torch_ddp`` and to ``local_floor``, and for the spmd
variants the collectives per step and the FLOPs of rank 0's convolutions relative to one device's
(``conv_flops_per_rank_vs_one_device``: 1/W when every convolution reads only its rank's rows).
Run: ``python bench/batch_norm.py [--rounds 20] [--width 16] [--batch 32] [--size 32] [--lower eager]``.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_expand as spmd
from spmd_expand.app.launch import run_local
from spmd_expand.app.models import classification_step
from spmd_expand.graph_stats import graph_flops
from spmd_expand.passes import SyncBatchNorm, default_passes
from timing import summary, time_interleaved  # bench/timing.py

WORLD = 2
WARMUP = 2
_CONVOLUTIONS = (torch.ops.aten.convolution, torch.ops.aten.convolution_backward)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(width: int, classes: int = 10) -> nn.Module:
    """ResNet-18's layout at ``width`` channels in the stem (torchvision's has 64), 3x3 stem."""
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, w in enumerate(widths):
        layers += [_Block(cin, w, 1 if i == 0 else 2), _Block(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def worker(rank: int, world: int, args: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = resnet18(args["width"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args["batch"], 3, args["size"], args["size"], generator=g)
    y = torch.randint(0, 10, (args["batch"],), generator=g)
    local = args["batch"] // world
    xl, yl = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    mesh = init_device_mesh("cpu", (world,))
    variants = {}
    others = default_passes(disable=["sync_batch_norm"])
    for name, passes in (
        ("spmd_ddp", "default"),
        ("spmd_ddp_statistics", [SyncBatchNorm(by_cost=False), *others]),
        ("spmd_ddp_no_sync_batch_norm", others),
    ):
        model = copy.deepcopy(base)
        optimizer = _sgd(model)
        step = spmd.compile(mesh=mesh, plan=spmd.DDP(), passes=passes, lower=args["lower"])(classification_step)
        variants[name] = ((lambda s=step, m=model, o=optimizer: s(m, o, xl, yl)), step)
    model = DistributedDataParallel(copy.deepcopy(base))
    optimizer = _sgd(model)
    variants["torch_ddp"] = ((lambda m=model, o=optimizer: classification_step(m, o, xl, yl)), None)
    model = copy.deepcopy(base)
    optimizer = _sgd(model)
    variants["local_floor"] = ((lambda m=model, o=optimizer: classification_step(m, o, xl, yl)), None)

    times, warmup_s = time_interleaved({name: run for name, (run, _) in variants.items()}, args["rounds"], WARMUP)

    one_device = None
    result = {}
    for name, samples in times.items():
        entry = {**summary(samples), "warmup_s": warmup_s[name]}
        step = variants[name][1]
        if step is not None:
            entry["collectives_per_step"] = step.last.collectives().as_dict()
            one_device = one_device or graph_flops(step.last.traced.graph_module, _CONVOLUTIONS)
            entry["conv_flops_per_rank_vs_one_device"] = round(graph_flops(step.last.local_graph, _CONVOLUTIONS) / one_device, 4)
        result[name] = entry
    for entry in result.values():
        for baseline in ("torch_ddp", "local_floor"):
            entry[f"ratio_to_{baseline}"] = entry["median_ms"] / result[baseline]["median_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--lower", default="eager", choices=("eager", "inductor"))
    args = vars(parser.parse_args())
    variants = run_local(worker, WORLD, args, timeout_s=3600)[0]
    print(json.dumps({"world_size": WORLD, "threads_per_rank": 1, "torch": torch.__version__, "config": args, "variants": variants}, indent=2))


if __name__ == "__main__":
    main()
