"""BatchNorm in the traced step: what it computes under a data-parallel plan, and the two module
settings that are handled before tracing.

The traced step is the single-device step over the global batch, so a BatchNorm in train mode
normalizes with the statistics of the *global* batch and updates ``running_mean``, ``running_var``
(unbiased) and ``num_batches_tracked`` as one device would: ``nn.SyncBatchNorm`` semantics, with no
module swap. DTensor's strategies for the batch-norm ops (``batch_norm_strategy`` and
``batch_norm_backward_strategy`` in ``torch/distributed/tensor/_ops/_math_ops.py``) keep the
reduced dims whole: the input is either replicated or sharded on channels, never split on the
batch, so a batch-sharded activation would be all-gathered (or moved to channel shards) before the
op. Under a plan that shards the batch the default pass ``sync_batch_norm``
(:mod:`spmd_expand.passes.sync_batch_norm`) writes the op as per-channel sums instead, all-reduced
as ``nn.SyncBatchNorm`` does, where by DTensor's communication model that costs less than the
gather (large activations). Either way every statistic is the global batch's. Buffers are
replicated plain tensors, updated in place on every rank.

:func:`traceable_batch_norms` wraps tracing and deals with:

* ``nn.SyncBatchNorm``: outside a process group it *is* ``F.batch_norm`` over its input, which is
  what the single-device step computes; inside one (every rank of a compiled step) its forward would
  start real collectives on the fake tensors being traced. It is traced as its single-device self,
  holding the same parameters and buffers.
* ``momentum=None`` (cumulative moving average) in train mode: the module reads
  ``num_batches_tracked`` into a Python float every call (``1.0 / float(self.num_batches_tracked)``),
  a value that would be baked into the graph as a constant. It raises :class:`TraceError` instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from .errors import TraceError

__all__ = ["traceable_batch_norms"]


class _SingleDeviceSyncBatchNorm(_BatchNorm):
    """``nn.SyncBatchNorm`` as it runs without a process group (``F.batch_norm`` over its input).

    Holds the original's parameters and buffers (the same tensor objects, under the same names), so
    their FQNs, placements and in-place buffer updates are the original's.
    """

    def __init__(self, sync: nn.SyncBatchNorm) -> None:
        nn.Module.__init__(self)  # not _BatchNorm.__init__: it would allocate new tensors
        self.num_features = sync.num_features
        self.eps = sync.eps
        self.momentum = sync.momentum
        self.affine = sync.affine
        self.track_running_stats = sync.track_running_stats
        self.training = sync.training
        self._parameters.update(sync._parameters)
        self._buffers.update(sync._buffers)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:  # SyncBatchNorm's own check: any (N, C, *) input
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def _check_momentum(fqn: str, module: nn.Module) -> None:
    if module.training and module.track_running_stats and module.momentum is None:
        raise TraceError(
            f"{type(module).__name__} {fqn!r} has momentum=None (cumulative moving average): in train "
            f"mode it reads num_batches_tracked into a Python float every step (1 / "
            f"num_batches_tracked), which a compiled graph would keep as a constant from its first "
            f"call, so the running statistics would be wrong from the second step on.\n"
            f"  fix: give the module a float momentum (e.g. momentum=0.1), or put it in eval mode "
            f"(module.eval()) if its running statistics are frozen"
        )


@contextlib.contextmanager
def traceable_batch_norms(model: nn.Module) -> Iterator[None]:
    """While tracing ``model``, swap each ``nn.SyncBatchNorm`` for its single-device stand-in.

    Restores the original modules on exit. The model's parameters and buffers are unchanged (the
    stand-ins hold the same tensors).

    Raises:
        TraceError: a batch-norm module in train mode with running statistics has ``momentum=None``.
    """
    for fqn, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            _check_momentum(fqn, module)
    accessor = NamedMemberAccessor(model)
    swapped: list[tuple[str, nn.Module]] = []
    try:
        for fqn, module in list(model.named_modules()):
            if isinstance(module, nn.SyncBatchNorm) and fqn:
                swapped.append((fqn, accessor.swap_submodule(fqn, _SingleDeviceSyncBatchNorm(module))))
        yield
    finally:
        for fqn, original in reversed(swapped):
            accessor.swap_submodule(fqn, original)
