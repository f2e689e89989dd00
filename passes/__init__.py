"""Graph passes of spmd_expand, one module each, run by torch.fx's ``PassManager``.

==========================  ======  ==============================================================
name                        stage   what it does
==========================  ======  ==============================================================
``sync_batch_norm``         global  a training BatchNorm's statistics as per-channel sums split on
                                    the batch (all-reduced, as ``nn.SyncBatchNorm``), instead of
                                    its input all-gathered, where DTensor's cost model says that
                                    is cheaper (:mod:`.sync_batch_norm`)
``regather_for_backward``   global  FSDP ``reshard_after_forward``: parameters gathered again per
                                    region (blocks' by default; :mod:`.regather`)
``horizontal_fusion``       global  the optimizer's per-parameter 0-d arithmetic (bias corrections,
                                    step sizes) as ops over one vector (:mod:`.horizontal_fusion`)
``bucketing``               local   gradient all-reduces in DDP-sized buckets (the returned loss's
                                    all-reduce in the last), parameter all-gathers and gradient
                                    reduce-scatters per block (:mod:`.bucketing`)
``overlap``                 local   collectives issued early and waited late; all-gathers prefetch
                                    one block ahead (:mod:`.overlap`)
==========================  ======  ==============================================================

``spmd.compile(passes="default")`` runs all five; ``passes=[...]`` takes names and pass objects
(:class:`SpmdPass` instances, or plain callables on the local graph); ``passes=[]`` runs none.
:func:`default_passes` builds the default list with some disabled by name.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence, Union

from ..errors import PassError
from .bucketing import BucketCollectives
from .horizontal_fusion import HorizontalFusion
from .manager import FunctionPass, PassContext, PassRecord, SpmdPass, run_passes
from .overlap import OverlapCollectives
from .regather import RegatherForBackward
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "SpmdPass",
    "FunctionPass",
    "PassContext",
    "PassRecord",
    "run_passes",
    "PASSES",
    "DEFAULT_PASSES",
    "default_passes",
    "resolve_passes",
    "RegatherForBackward",
    "SyncBatchNorm",
    "HorizontalFusion",
    "BucketCollectives",
    "OverlapCollectives",
]

PASSES: dict[str, Callable[[], SpmdPass]] = {
    SyncBatchNorm.name: SyncBatchNorm,
    RegatherForBackward.name: RegatherForBackward,
    HorizontalFusion.name: HorizontalFusion,
    BucketCollectives.name: BucketCollectives,
    OverlapCollectives.name: OverlapCollectives,
}
"""Pass name -> factory of the pass with its default settings."""

DEFAULT_PASSES = ("sync_batch_norm", "regather_for_backward", "horizontal_fusion", "bucketing", "overlap")
"""What ``passes="default"`` runs."""

PassSpec = Union[str, SpmdPass, Callable[..., Any]]


def default_passes(disable: Iterable[str] = ()) -> list[str]:
    """The default pass names without those in ``disable``.

    Raises:
        PassError: ``disable`` names a pass that is not a default pass.
    """
    disable = list(disable)
    unknown = [name for name in disable if name not in DEFAULT_PASSES]
    if unknown:
        raise PassError(f"cannot disable {unknown}: the default passes are {list(DEFAULT_PASSES)}")
    return [name for name in DEFAULT_PASSES if name not in disable]


def resolve_passes(passes: Union[str, Sequence[PassSpec], None]) -> tuple[list[SpmdPass], list[SpmdPass]]:
    """``(global passes, local passes)`` for the ``passes=`` argument of ``spmd.compile``.

    ``"default"`` (or None) is :data:`DEFAULT_PASSES`; a list takes pass names (:data:`PASSES`),
    :class:`SpmdPass` objects, and plain callables ``fn(gm)`` (run as local passes, in order).

    Raises:
        PassError: an unknown name, a name given twice, or something that is not a pass.
    """
    if passes is None or passes == "default":
        passes = list(DEFAULT_PASSES)
    elif isinstance(passes, str):
        raise PassError(f'passes={passes!r}: use "default", or a list of pass names from {sorted(PASSES)}')
    resolved: list[SpmdPass] = []
    for p in passes:
        if isinstance(p, str):
            if p not in PASSES:
                raise PassError(f"unknown pass {p!r}; the passes are {sorted(PASSES)}")
            resolved.append(PASSES[p]())
        elif isinstance(p, SpmdPass):
            resolved.append(p)
        elif callable(p):
            fp = FunctionPass(p)
            if any(q.name == fp.name for q in resolved):
                fp.name = f"{fp.name}_{len(resolved)}"
            resolved.append(fp)
        else:
            raise PassError(f"{p!r} is not a pass: give a name from {sorted(PASSES)}, an SpmdPass or a callable")
    names = [p.name for p in resolved]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PassError(f"passes {twice} given more than once")
    return [p for p in resolved if p.stage == "global"], [p for p in resolved if p.stage == "local"]
