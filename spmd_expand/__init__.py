"""spmd_expand: compile a single-device PyTorch train step into an SPMD program.

    import spmd_expand as spmd

    @spmd.compile(mesh=mesh, plan=spmd.DDP())
    def train_step(model, optimizer, x, y): ...

Stages (one module each; the order is written in ``pipeline``): trace -> global passes -> propagate ->
expand -> local passes (``spmd_expand.passes``) -> lower; see ``api.compile``.
"""

from . import fused_optimizer_ops, ops  # noqa: F401  (register Meta kernels of fused optimizers; spmd_expand::gradient)
from .api import CompiledStep, Override, StepArtifacts, compile
from .backend import parallelize
from .dsymint import DSymInt
from .errors import BatchError, CollectiveError, DivergenceError, PassError, PlacementError, PlanError, SpmdError, TraceError, UnsupportedOpError
from .plans import DDP, FSDP, ParallelStyle, TensorParallel
from .replicas import check_replicas

__all__ = [
    "compile",
    "parallelize",
    "check_replicas",
    "CompiledStep",
    "StepArtifacts",
    "Override",
    "DDP",
    "FSDP",
    "TensorParallel",
    "ParallelStyle",
    "DSymInt",
    "SpmdError",
    "TraceError",
    "PlanError",
    "UnsupportedOpError",
    "PlacementError",
    "BatchError",
    "DivergenceError",
    "CollectiveError",
    "PassError",
]
