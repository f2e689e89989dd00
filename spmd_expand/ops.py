"""Custom ops that mark points of the traced step for later stages.

``spmd_expand::gradient(grad, fqn)`` marks the gradient of parameter ``fqn`` as the optimizer reads it
(after all micro-batches have accumulated into it). Propagation pins its output to the plan's gradient
placement, so the reduction (all-reduce for DDP, reduce-scatter for FSDP) happens exactly there, once per
step; expansion replaces the marker by that redistribution. On one device it is the identity.
"""

from __future__ import annotations

import torch

__all__ = ["gradient"]


@torch.library.custom_op("spmd_expand::gradient", mutates_args=())
def gradient(grad: torch.Tensor, fqn: str) -> torch.Tensor:
    """Identity on ``grad`` (any shape), tagged with the owning parameter's FQN."""
    return grad.clone()


@gradient.register_fake
def _(grad: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(grad)


GRADIENT = torch.ops.spmd_expand.gradient.default
