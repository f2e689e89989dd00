"""The compiler pipeline: the one place where the order of the stages is written.

    trace -> global passes -> propagate -> expand -> local passes -> lower

* **trace** (:mod:`~spmd_expand.trace`): ``make_fx`` of the whole step (forward, backward, optimizer)
  on fake global tensors: the global graph.
* **global passes** (:mod:`spmd_expand.passes`, ``stage="global"``): rewrite the global graph before
  placements exist (e.g. ``regather_for_backward``).
* **propagate** (:mod:`~spmd_expand.propagate`): DTensor's sharding propagation, node by node.
* **expand** (:mod:`~spmd_expand.expand`): this rank's local graph, collectives spliced in; then every
  node gets ``meta["val"]``, a fake tensor of its local shape.
* **local passes** (``stage="local"``): bucketing, overlap, ... then each ``Override.transform``.
* **lower** (:mod:`~spmd_expand.lower`): Inductor or the fx graph as is.

:class:`~spmd_expand.api.CompiledStep` finds the model and optimizer, keeps the cache and its guards,
the DTensor state and the write-back; it calls :func:`compile_step` once per distinct state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from .annotate import output_placements
from .batch_norm import traceable_batch_norms
from .errors import TraceError
from .expand import RedistributeCache, expand
from .graph_stats import annotate_local_values
from .lower import lower as lower_graph
from .passes.manager import PassContext, PassRecord, SpmdPass, copy_graph_module, run_passes
from .plans import ResolvedPlan
from .propagate import propagate
from .trace import TracedStep, trace_step

__all__ = ["Override", "StepArtifacts", "compile_step", "STAGES"]

STAGES = ("trace", "global_passes", "propagate", "expand", "local_passes", "lower")
"""Stage names, in order; :attr:`StepArtifacts.seconds` has one entry per stage."""


class Override:
    """Swap a submodule that cannot be traced for a traceable stand-in while the step is traced.

    Subclass and implement :meth:`replacement`; optionally :meth:`transform`, which receives the
    expanded local graph after the local passes. The stand-in must hold the original's parameters
    (the same tensor objects) so they keep their FQNs' placements; it may hold no parameters of its own.
    """

    def replacement(self, fqn: str, module: nn.Module) -> nn.Module:
        """The stand-in for submodule ``fqn`` (return ``module`` itself to keep it)."""
        raise NotImplementedError

    def transform(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Rewrite the expanded local graph (e.g. splice the real computation back in)."""
        return gm


@dataclass
class StepArtifacts:
    """What one compilation produced; kept for inspection (tests, ``spmd-expand dump``).

    Attributes:
        traced: the global graph (after the global passes, annotated with placements) and its roles.
        expanded: this rank's graph as expansion made it, before the local passes (the same object as
            ``local_graph`` when no local pass ran; a copy otherwise).
        local_graph: the graph that was lowered.
        passes: one record per pass that ran (global first), with its seconds and, when the step was
            compiled with ``keep_graphs``, the graph after it.
        runner: the lowered callable: ``runner(*local_inputs, *hyperparameter_values) -> outputs``.
        seconds: wall seconds per stage (:data:`STAGES`).
    """

    traced: TracedStep
    local_graph: fx.GraphModule
    runner: Callable[..., list]
    seconds: dict[str, float] = field(default_factory=dict)
    expanded: Optional[fx.GraphModule] = None
    passes: list[PassRecord] = field(default_factory=list)


class _overrides:
    """Swap submodules per ``Override.replacement`` for the duration of tracing."""

    def __init__(self, model: nn.Module, overrides: Sequence[Override]):
        self.model = model
        self.overrides = overrides
        self.swapped: list[tuple[str, nn.Module]] = []

    def __enter__(self):
        if not self.overrides:
            return self
        accessor = NamedMemberAccessor(self.model)
        before = {id(p) for p in self.model.parameters()}
        for fqn, module in list(self.model.named_modules()):
            if not fqn:
                continue
            for override in self.overrides:
                stand_in = override.replacement(fqn, module)
                if stand_in is not module:
                    self.swapped.append((fqn, accessor.swap_submodule(fqn, stand_in)))
                    break
        extra = {id(p) for p in self.model.parameters()} - before
        if extra:
            self.__exit__(None, None, None)
            raise TraceError("an Override's stand-in holds parameters the original model does not; reuse the original's")
        return self

    def __exit__(self, *exc):
        accessor = NamedMemberAccessor(self.model)
        for fqn, original in reversed(self.swapped):
            accessor.swap_submodule(fqn, original)
        self.swapped.clear()
        return False


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def stage(self, name: str):
        clock = self

        class _Timer:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                clock.seconds[name] = time.perf_counter() - self.start
                return False

        return _Timer()


def compile_step(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    roles: Sequence,
    specs: Sequence,
    placements: Sequence,
    example_inputs: Sequence[Any],
    *,
    mesh: DeviceMesh,
    plan: ResolvedPlan,
    grad_placements: Callable[[str], Any],
    gradient_sync: bool,
    global_passes: Sequence[SpmdPass],
    local_passes: Sequence[SpmdPass],
    module_override: Sequence[Override],
    redistribute_cache: RedistributeCache,
    lower: str,
    keep_graphs: bool = False,
) -> StepArtifacts:
    """Run every stage once for the step's current state and return what it produced.

    ``roles``/``specs``/``placements`` describe the graph's tensor inputs (global shapes, the plan's
    placements); ``example_inputs`` are this rank's local values of every graph input (tensor inputs,
    then hyperparameter values). ``grad_placements(fqn)`` is where each gradient must be reduced to.

    Raises:
        TraceError, UnsupportedOpError, PlacementError, PassError: from the stage that failed.
    """
    clock = _Clock()
    params = dict(model.named_parameters())
    with clock.stage("trace"), _overrides(model, module_override), traceable_batch_norms(model):
        traced = trace_step(fn, args, kwargs, model, optimizer, roles, specs, plan.module_layouts())

    context = PassContext(mesh=mesh, plan=plan, traced=traced)
    with clock.stage("global_passes"):
        global_gm, records = run_passes(traced.graph_module, global_passes, context, keep_graphs)
        traced.graph_module = global_gm

    with clock.stage("propagate"):
        out_placements = output_placements(traced, model, mesh, plan, gradient_sync)
        propagate(
            traced,
            mesh,
            placements,
            out_placements,
            grad_placements=grad_placements,
            compute_placements=lambda fqn: plan.compute_placements(fqn, params[fqn]),
        )

    with clock.stage("expand"):
        local = expand(traced.graph_module, redistribute_cache)
        annotate_local_values(local, list(example_inputs))
    expanded = local

    with clock.stage("local_passes"):
        if local_passes:
            expanded = copy_graph_module(local)
        local, local_records = run_passes(local, local_passes, context, keep_graphs)
        records += local_records
        for override in module_override:
            local = override.transform(local)

    with clock.stage("lower"):
        runner = lower_graph(local, example_inputs, lower, ran_passes={r.name for r in records})
    return StepArtifacts(traced, local, runner, clock.seconds, expanded, records)
