"""Named plans for the command-line tools (``spmd-expand train`` and ``dump``): one table, one place.

Each preset names the mesh dims it needs, in order, and builds its plan for a model. Tensor-parallel
presets ask the model for its plan (``model.tensor_parallel_plan()``, which the built-in GPT and MLP
provide); from Python, pass ``spmd.TensorParallel({...})`` for any model instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import PlanError
from ..plans import DDP, FSDP, Plan, TensorParallel

__all__ = ["Preset", "PRESETS", "preset", "preset_mesh", "mesh_shape"]


@dataclass(frozen=True)
class Preset:
    """A plan name: the mesh dims it needs (names, in order) and how to build it for a model."""

    mesh_dim_names: tuple[str, ...]
    build: Callable[[nn.Module], Plan]
    help: str


def _tp(model: nn.Module) -> TensorParallel:
    plan = getattr(model, "tensor_parallel_plan", None)
    if plan is None:
        raise PlanError(
            f"{type(model).__name__} has no tensor_parallel_plan(); tensor-parallel presets work for models "
            f"that provide one (the built-in GPT and MLP); otherwise pass spmd.TensorParallel({{...}}) in Python"
        )
    return TensorParallel(plan())


PRESETS: dict[str, Preset] = {
    "ddp": Preset(("dp",), lambda m: DDP(), "DDP: parameters replicated, gradients all-reduced"),
    "fsdp": Preset(("dp",), lambda m: FSDP(), "FSDP: parameters Shard(0), blocks gathered again for backward"),
    "fsdp-keep": Preset(
        ("dp",), lambda m: FSDP(reshard_after_forward=False), "FSDP keeping gathered parameters for backward"
    ),
    "tp": Preset(("tp",), _tp, "tensor parallel (the model's Megatron plan)"),
    "fsdp+tp": Preset(("dp", "tp"), lambda m: {"dp": FSDP(), "tp": _tp(m)}, "2-D: FSDP over dp, TP over tp"),
    "ddp+tp": Preset(("dp", "tp"), lambda m: {"dp": DDP(), "tp": _tp(m)}, "2-D: DDP over dp, TP over tp"),
    "hsdp": Preset(
        ("replicate", "shard"), lambda m: {"replicate": DDP(), "shard": FSDP()}, "HSDP: DDP across groups, FSDP within"
    ),
}


def preset(name: str) -> Preset:
    """The preset called ``name``. Raises PlanError naming the known ones."""
    if name not in PRESETS:
        raise PlanError(f"unknown plan {name!r}; one of {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_mesh(name: str, shape: tuple[int, ...], device_type: str = "cpu") -> DeviceMesh:
    """A ``DeviceMesh`` of ``shape`` with the dim names preset ``name`` needs.

    Raises:
        PlanError: ``shape`` has another number of dims than the preset needs.
    """
    names = preset(name).mesh_dim_names
    if len(shape) != len(names):
        raise PlanError(
            f"plan {name} needs a {len(names)}-D mesh ({', '.join(names)}); got mesh shape {'x'.join(map(str, shape))}"
        )
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=names)


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type`` for counts and sizes: an int >= 1."""
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    """argparse ``type`` for an int >= 0."""
    return _int_at_least(0, text)


def mesh_shape(text: str) -> tuple[int, ...]:
    """Parse ``--mesh``: ``"8"`` -> ``(8,)``, ``"2x4"`` -> ``(2, 4)`` (argparse ``type``)."""
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh shape like 8 or 2x4")
    return tuple(int(p) for p in parts)
