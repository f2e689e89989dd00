"""Custom ops that mark points of the traced step for later stages.

``spmd_expand::unshard(param, fqn)`` marks where the module reads parameter ``fqn``; see
:func:`unshard`. ``spmd_expand::layout(t, mesh_dim, placement)`` asks for a placement at a module
boundary (tensor parallel); see :func:`layout`.

``spmd_expand::sequence_first(t, fqn)`` marks the input of a module that reads dim 0 as the sequence
(``batch_first=False``); see :func:`sequence_first`.

``spmd_expand::gradient(grad, fqn)`` marks the gradient of parameter ``fqn`` as the optimizer reads it
(after all micro-batches have accumulated into it). Propagation pins its output to the plan's gradient
placement, so the reduction (all-reduce for DDP, reduce-scatter for FSDP) happens exactly there, once per
step; expansion replaces the marker by that redistribution. On one device it is the identity.
"""

from __future__ import annotations

import torch

__all__ = ["gradient", "unshard", "layout", "sequence_first", "GRADIENT", "UNSHARD", "LAYOUT", "SEQUENCE_FIRST"]


@torch.library.custom_op("spmd_expand::gradient", mutates_args=())
def gradient(grad: torch.Tensor, fqn: str) -> torch.Tensor:
    """Identity on ``grad`` (any shape), tagged with the owning parameter's FQN."""
    return grad.clone()


@gradient.register_fake
def _(grad: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(grad)


GRADIENT = torch.ops.spmd_expand.gradient.default


@torch.library.custom_op("spmd_expand::unshard", mutates_args=())
def unshard(param: torch.Tensor, fqn: str) -> torch.Tensor:
    """Identity on ``param``, marking where the module reads parameter ``fqn``.

    Propagation gives its output the plan's *compute* placement of the parameter (FSDP: replicated
    over the data-parallel dim, i.e. an all-gather; DDP and tensor parallel: the storage placement,
    i.e. nothing). Gradients flow through it unchanged to the stored parameter.
    """
    return param.clone()


@unshard.register_fake
def _(param: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(param)


def _pass_gradient(ctx, grad: torch.Tensor):
    """Backward of an identity marker over ``(tensor, fqn)``: the gradient unchanged."""
    return grad, None


unshard.register_autograd(_pass_gradient)

UNSHARD = torch.ops.spmd_expand.unshard.default


@torch.library.custom_op("spmd_expand::layout", mutates_args=())
def layout(tensor: torch.Tensor, mesh_dim: int, placement: str, grad_placement: str = "") -> torch.Tensor:
    """Identity on ``tensor``, asking for ``placement`` on mesh dim ``mesh_dim`` at this point.

    ``placement`` is ``"R"`` (replicate) or ``"S<dim>"`` (shard on tensor dim ``<dim>``, negative
    dims count from the end). Placed at the inputs and outputs of modules a tensor-parallel style
    names (its ``desired_input_layouts`` / ``output_layouts``). The gradient passes through a
    ``layout`` marker asking for ``grad_placement``, or unchanged when it is empty.
    """
    return tensor.clone()


@layout.register_fake
def _(tensor: torch.Tensor, mesh_dim: int, placement: str, grad_placement: str = "") -> torch.Tensor:
    return torch.empty_like(tensor)


def _layout_setup_context(ctx, inputs, output) -> None:
    _, ctx.mesh_dim, _, ctx.grad_placement = inputs


def _layout_backward(ctx, grad: torch.Tensor):
    if ctx.grad_placement:
        grad = layout(grad, ctx.mesh_dim, ctx.grad_placement)
    return grad, None, None, None


layout.register_autograd(_layout_backward, setup_context=_layout_setup_context)

LAYOUT = torch.ops.spmd_expand.layout.default


@torch.library.custom_op("spmd_expand::sequence_first", mutates_args=())
def sequence_first(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """Identity on ``tensor``, the input of module ``fqn`` that reads its dim 0 as the sequence (an
    ``nn.LSTM``/``GRU``/``RNN`` or ``nn.MultiheadAttention`` with ``batch_first=False``, as in
    ``nn.Transformer*`` layers by default). After propagation, a data-parallel split of that dim is
    refused (:func:`spmd_expand.boundaries.refuse_split_sequences`); expansion drops the marker.
    Gradients pass through it unchanged."""
    return tensor.clone()


@sequence_first.register_fake
def _(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(tensor)


sequence_first.register_autograd(_pass_gradient)

SEQUENCE_FIRST = torch.ops.spmd_expand.sequence_first.default
