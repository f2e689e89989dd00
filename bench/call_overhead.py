"""Python overhead of one call of a compiled step, outside the compiled graph, against parameter count.

Each call of ``spmd.compile``'s step checks that the model and optimizer are still what the graph was
compiled for (:mod:`spmd_expand.guards`), collects the graph's local inputs and writes results back.
This measures that time alone: on torch's fake process group (no communication; the per-call batch
all-gather is skipped there), with the compiled graph replaced by a function returning the outputs of
a real call, for MLPs of ``n`` linear layers (``2n`` parameters) trained by AdamW. Baselines in the
same run: ``optimizer.zero_grad()`` of the same model, an O(parameters) loop in torch itself, and a
call of ``torch.compile(model)`` (Dynamo's guards over the module and its parameters, its inputs and
outputs) whose compiled graph is likewise replaced by a function returning the outputs of a real call.

Prints one JSON object: per parameter count, the median microseconds per call of the fast path
(same state as the previous call) and of the full path (forced by dropping the binding each call),
and the baselines'.
Run: ``python bench/call_overhead.py [--layers 4 64 500] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import spmd_expand as spmd
from spmd_expand.tools.dump import fake_process_group


def _step(model, optimizer, x):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _median_us(fn, calls: int) -> float:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


def measure(layers: int, calls: int, mesh) -> dict:
    model = _mlp(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    step = spmd.compile(mesh=mesh, plan=spmd.DDP(), lower="eager")(_step)
    x = torch.randn(4, 8)
    step(model, optimizer, x)
    step(model, optimizer, x)
    artifacts = step.last
    binding = step._binding
    values = [hp.read(optimizer) for hp in binding.hyperparameters]
    with torch.no_grad():  # as the step runs its graph: the graph updates leaf tensors in place
        outputs = artifacts.runner(*binding.local_inputs([x]), *values)
    artifacts.runner = lambda *inputs: outputs  # the graph itself is not measured

    def full():
        step._binding = None
        step(model, optimizer, x)

    result = {
        "parameters": sum(1 for _ in model.parameters()),
        "fast_path_us": _median_us(lambda: step(model, optimizer, x), calls),
        "full_path_us": _median_us(full, max(calls // 10, 5)),
        "torch_zero_grad_us": _median_us(lambda: optimizer.zero_grad(set_to_none=False), calls),
        "torch_compile_call_us": _torch_compile_call_us(layers, calls),
    }
    return result


def _torch_compile_call_us(layers: int, calls: int) -> float:
    """Median microseconds of a call of ``torch.compile(model)`` outside its graph, for the same MLP
    with plain parameters: the backend returns a function giving the outputs of one real run."""

    def backend(gm, example_inputs):
        outputs = gm(*example_inputs)
        return lambda *inputs: outputs

    torch._dynamo.reset()
    compiled = torch.compile(_mlp(layers), backend=backend)
    x = torch.randn(4, 8)
    compiled(x)
    compiled(x)
    return _median_us(lambda: compiled(x), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 64, 500])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    with fake_process_group(2) as _:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        rows = [measure(n, args.calls, mesh) for n in args.layers]
    print(json.dumps({"torch": torch.__version__, "plan": "DDP", "world_size": 2, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
