"""``torch.compile(model, backend="spmd")``: every graph Dynamo captures, compiled through our stages.

    model = spmd.parallelize(model, mesh, plan)     # parameters become DTensors with the plan's placements
    cmodel = torch.compile(model, backend="spmd", options={"mesh": mesh, "plan": plan})
    loss = F.cross_entropy(cmodel(x), y)            # x, y: this rank's local batch
    loss.backward(); optimizer.step()               # eager optimizer, schedulers, clipping, DCP

:func:`parallelize` converts the model as ``spmd.compile``'s first call does
(:func:`~spmd_expand.state.distribute_state`), makes its buffers replicated DTensors, and wraps the root
module's ``forward``: local batch tensors in (``DTensor.from_local`` with the plan's batch placements),
local results out (``redistribute`` to the batch placements, then ``to_local``). Dynamo traces through
the wrapper and the model's own ``forward`` as one frame, so each graph it captures reads DTensor
parameters and produces DTensors, and a model without graph breaks is one graph.

:func:`spmd_backend` (registered as ``spmd`` through the ``torch_dynamo_backends`` entry point) reads
one such graph as the single-device program it describes: ``from_local``/``redistribute``/
``to_local`` are identities on global values, parameters are global tensors. It traces forward and
backward together (the joint graph, as AOTAutograd does; :func:`spmd_expand.trace.trace_step`) with the
placements of the graph's DTensor inputs, propagates and expands it (collectives spliced in, gradients
reduced per the plan), runs the local passes, splits it into forward and backward
(AOTAutograd's ``min_cut_rematerialization_partition``) and lowers each with Inductor. The result is an
``autograd.Function`` over local tensors: parameter gradients come back as DTensors with the
parameters' placements, so ``param.grad`` is what the eager optimizer expects.

Gradient convention (DDP's): a result returned as a local tensor feeds a per-rank loss, and the
gradient is the mean over the data-parallel ranks of the per-rank gradients; for a result sharded on
the batch this equals one device's gradient of the global batch's mean loss. The backward graph
divides the incoming gradient of such results by the data-parallel size, inside the graph.

Values that cross a graph break stay DTensors with the placements Dynamo traced them with; the
compiled graph returns exactly those placements.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import threading
import time
import types
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from . import ops
from .state import REPLACED_PARAMETERS, broadcast_materialized_state, distribute_state
from .boundaries import encode_placement, mark_boundaries, mark_sequence_first
from .errors import BatchError, PlanError, SpmdError, user_source_line
from .expand import RedistributeCache
from .graph_stats import COLLECTIVES
from .eager_fallback import ForwardMode
from .guards import not_dense_problem
from .lower import LOWERINGS, lower as lower_graph
from .passes import resolve_passes
from .pipeline import JointArtifacts, cyclic_gc_paused, describe_compilation, expand_joint, log, stage_seconds
from .plans import Plan, ResolvedPlan, TensorParallel, _DataParallel, resolve_plan
from .spec import replicate
from .python_values import PythonGuards
from .rank_check import check_ranks_agree
from .rng import GENERATOR_FIX, generator_state
from .trace import InputRole, TensorSpec, TracedStep
from .watch import as_timedelta, set_group_timeouts

__all__ = ["parallelize", "spmd_backend", "BackendStats", "stats"]


CALL_FIX = (
    "every rank must run the same compiled graph at each call; under torch.compile each rank's Dynamo "
    "guards decide alone whether a call reuses a graph or compiles a new one, so a rank that compiles "
    "where the others run a graph compiled before (or runs another one) was handed a batch of another "
    "shape (a short last batch: DataLoader(drop_last=True) or a DistributedSampler, which gives every "
    "rank the same count; padding to each rank's longest sequence: pad every rank to one length), or "
    "has a module in another train()/eval() mode, or reads a Python value that depends on the rank"
)
"""What to do when ranks run different compiled graphs at one call (:meth:`_Runtime.check_call`)."""


# ---------------------------------------------------------------------------------------------- parallelize


@dataclass
class _Parallelized:
    mesh: DeviceMesh
    plan: Plan
    resolved: ResolvedPlan
    timeout: Optional[timedelta] = None  # parallelize's timeout: the cross-rank checks' wait


class _HookContexts:
    """The context managers that keep a parallelized model's boundary hooks installed, held by the
    model. A deep copy of the model (an EMA copy) copies the hooks themselves (functions, by
    reference) and gets an empty holder: generators cannot be copied."""

    def __init__(self, contexts: Optional[contextlib.ExitStack]) -> None:
        self.contexts = contexts

    def __deepcopy__(self, memo: dict) -> "_HookContexts":
        return _HookContexts(None)


_PARALLELIZED: "weakref.WeakKeyDictionary[nn.Module, _Parallelized]" = weakref.WeakKeyDictionary()


def parallelize(
    model: nn.Module, mesh: DeviceMesh, plan: Plan, *, timeout: Union[None, float, timedelta] = None
) -> nn.Module:
    """Make ``model`` an SPMD module for ``torch.compile(model, backend="spmd")``; returns ``model``.

    Parameters become DTensors with ``plan``'s placements (the conversion of ``spmd.compile``'s first
    call: replicated ones broadcast from rank 0, sharded ones this rank's shard), buffers replicated
    DTensors. A model on the meta device gets meta DTensors of this rank's local shapes and no
    communication: then ``model.to_empty(device=...)`` and initialize or load a checkpoint.
    ``model.forward`` then takes this rank's local batch (plain tensors, split on the batch dim under
    DDP/FSDP) and returns local results (this rank's rows of a batch-shaped result; the full value of
    a scalar): :func:`_wrap_forward`. Build the optimizer after this call, over ``model.parameters()``.

    The model must then run under ``torch.compile(..., backend="spmd")``: run eagerly, its forward
    raises (eager DTensor execution would sum, not average, the ranks' gradients).
    Parameters stored sharded (FSDP) are read in their compute placements while Dynamo traces
    (:func:`_read_parameters_in_compute_placements`; each such module's class becomes a subclass).

    ``torch._dynamo.reset()`` drops the compile callbacks this installs: call ``parallelize`` again
    (on the same model, with the same mesh and plan) after it.

    ``timeout`` (seconds or a ``timedelta``), as in :func:`spmd.compile <spmd_expand.api.compile>`: set on
    the mesh's process groups; a collective of a compiled graph that fails or times out raises
    ``CollectiveError`` naming its node.

    Raises:
        PlanError: ``plan`` does not fit ``model`` (from :func:`~spmd_expand.plans.resolve_plan`),
            gives an ``mp_policy`` (applied by ``spmd.compile`` only, for now), or the model has an
            ``nn.RNN``/``LSTM``/``GRU`` while ``torch._dynamo.config.allow_rnn`` is off
            (:func:`_refuse_recurrent_modules`); the model is unchanged.
        SpmdError: ``model`` is already parallelized for another mesh or plan, or ``timeout`` is not a
            positive number of seconds.
    """
    timeout = as_timedelta(timeout, "spmd.parallelize: timeout")
    _replicate_plain_tensors_while_tracing()
    known = _PARALLELIZED.get(model)
    if known is not None:
        if known.mesh is not mesh or known.plan is not plan:
            raise SpmdError("spmd.parallelize: this model is already parallelized with another mesh or plan")
        return model
    resolved = resolve_plan(plan, mesh, model)
    _refuse_recurrent_modules(model)
    if resolved.mixed_precision(model) is not None:
        raise PlanError(
            "spmd.parallelize: the plan's mp_policy is applied by spmd.compile (whole-step graph); the "
            "torch.compile backend does not apply it yet, and would train in the parameters' dtype\n"
            "  fix: compile the whole step with spmd.compile(mesh=..., plan=...), or drop mp_policy and use "
            "torch.autocast inside the model's forward"
        )
    if timeout is not None:
        set_group_timeouts(mesh, timeout)
    distribute_state(model, None, mesh, resolved, timeout)
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and not isinstance(buf, DTensor):
                # A meta buffer has no values to broadcast (meta-device initialization).
                module._buffers[name] = distribute_tensor(buf, mesh, replicate(mesh), src_data_rank=None if buf.is_meta else 0)

    _reduce_gradients_computed_eagerly(model, mesh, resolved)
    _read_parameters_in_compute_placements(model, resolved)
    _warn_about_kv_cache(model, resolved)
    _wrap_forward(model, mesh, resolved)
    # Tensor-parallel module boundaries: the styles' redistributions, as torch's own hooks do them.
    boundaries = contextlib.ExitStack()
    boundaries.enter_context(mark_boundaries(model, resolved.module_layouts()))
    boundaries.enter_context(mark_sequence_first(model, mesh, resolved.data_parallel_dims))
    # The hooks stay while their context managers are alive (a collected one removes its hooks): the
    # model holds them. In the registry's value they would hold the model, which a weak key must not
    # (no model was ever freed, and a later graph reading no parameters matched every earlier model).
    model._spmd_boundary_hooks = _HookContexts(boundaries)
    _PARALLELIZED[model] = _Parallelized(mesh, plan, resolved, timeout)
    return model


def _wrap_forward(model: nn.Module, mesh: DeviceMesh, resolved: ResolvedPlan) -> None:
    """Make ``model.forward`` (an attribute of the instance) take local batch tensors and return local results.

    Inputs: each plain tensor becomes ``DTensor.from_local`` with the plan's batch placements; outputs:
    each DTensor with rows (split, or with a dim of the global batch's size on the batch dim) is
    redistributed to the batch placements (rows split on another dim stay split there), one without
    to replicated, then ``to_local``. A placement cannot tell rows every rank computed from a statistic
    of the batch's width: an output split nowhere, with the batch's size and fewer dims than the batch,
    is taken as rows with a warning. A wrapper of ``forward``
    rather than forward hooks: ``torch.compile(model)`` runs a module's hooks outside Dynamo and
    compiles each hook as a graph of its own (three graphs per call, each with its own runtime and
    autograd node, and the loss's all-reduce alone in the last); the wrapper is traced in one frame
    with the model's ``forward``. ``inspect.signature(model.forward)`` is the model's.
    """
    inner = model.__dict__.get("forward")  # an instance-level forward someone set before us
    class_forward = type(model).forward

    def to_dtensor(t: torch.Tensor) -> torch.Tensor:
        not_dense = not_dense_problem(t)
        if not_dense is not None:
            raise BatchError(f"{type(model).__name__}.forward: a tensor argument {not_dense}")
        return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, resolved.batch_placements(t), run_check=False)

    def batch_dims(t: torch.Tensor) -> set[int]:
        return {p.dim for p in resolved.batch_placements(t) if isinstance(p, Shard) and p.dim < t.dim()}

    def to_local(t: DTensor, batch_sizes: set[int], batch_ndim: int) -> torch.Tensor:
        # An output with no dim of the global batch's size on the batch dim, split nowhere (a statistic
        # over the batch, a scalar, a value of parameters alone), has no rows of this rank: its full
        # value, as one device's. Others: this rank's rows (a replicated or partial one too: rows every
        # rank computed for the whole batch, `torch.sort(h, 0)`, `h - h.mean(0, keepdim=True)`).
        split = any(p.is_shard() for p in t.placements)
        rows = split or any(t.shape[d] in batch_sizes for d in batch_dims(t))
        if rows and not split and t.dim() < batch_ndim:
            # Fewer dims than the batch and split nowhere: likely a statistic over the batch whose width
            # is the global batch's size (`h.var(0)` of B features). Its placements cannot tell.
            warnings.warn(
                f"torch.compile(backend=\"spmd\"): an output of {type(model).__name__}.forward of shape "
                f"{tuple(t.shape)} is split over no rank ({tuple(t.placements)}) and has the global batch's size "
                f"on its batch dim: it is returned as this rank's rows of it. If it is a statistic over the batch whose "
                f"width happens to equal the global batch size, each rank gets a slice of it instead of its full "
                f"value: give it another size, or compute it from the rows outside the compiled model",
                stacklevel=2,
            )
        if not rows:
            return t.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        # Rows split on another dim than the plan's batch dim (a batch-first input's sequence-first
        # output, `(T, B, C)`: Shard(1)) stay split there: this rank's rows, as the next op expects them.
        wanted = resolved.batch_placements(t)
        return t.redistribute(mesh, [p if p.is_shard() and w.is_shard() else w for p, w in zip(t.placements, wanted)]).to_local()

    mode = ForwardMode(mesh)

    @functools.wraps(class_forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        _require_compiling()
        args, kwargs = pytree.tree_map_only(torch.Tensor, to_dtensor, (args, kwargs))
        batch = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DTensor) and batch_dims(t)]
        batch_sizes = {t.shape[d] for t in batch for d in batch_dims(t)}
        # (Dynamo traces this: min(..., default=) would break the graph.)
        batch_ndim = min([t.dim() for t in batch]) if batch else 0
        with mode:
            output = inner(*args, **kwargs) if inner is not None else class_forward(self, *args, **kwargs)
        return pytree.tree_map_only(DTensor, functools.partial(to_local, batch_sizes=batch_sizes, batch_ndim=batch_ndim), output)

    model.forward = types.MethodType(forward, model)


def _reduce_gradients_computed_eagerly(model: nn.Module, mesh: DeviceMesh, resolved: ResolvedPlan) -> None:
    """After a parameter's gradient is accumulated, bring it to the plan's gradient placements if it is
    not there yet (an all-reduce from ``Partial`` under DDP, a reduce-scatter under FSDP), warning once.

    A gradient our compiled graphs produce already is (DDP: replicated, FSDP: its shard): the hook
    compares placements and returns. One that is not came from DTensor's eager autograd: Dynamo ran
    part of the model eagerly. A graph break inside a module of ``torch.nn`` (an ``nn.Sequential``
    whose child breaks, e.g. on ``F.interpolate``) did so for that module's whole forward before the
    forward ran under :class:`~spmd_expand.forms.EqualForms` (with the mode on, Dynamo compiles the
    children as graphs of their own), and eager calls inside the forward now run as one device would
    (:class:`~spmd_expand.eager_fallback.ForwardMode`: their gradients arrive in the plan's placements);
    the hook stays for eager DTensor code outside the forward. Its values are right (the
    compiled graph of the model's result scales each rank's loss by ``1 / data-parallel size``), but
    eager DTensor leaves a data-parallel gradient ``Partial``: the optimizer would reduce it again in
    every op that reads it, and code reading ``grad.to_local()`` would see one rank's part.
    """
    warned = False
    for fqn, param in model.named_parameters():
        wanted = resolved.grad_placements(fqn, param)
        if not param.requires_grad or wanted is None:
            continue

        def reduce(p: torch.Tensor, fqn: str = fqn, wanted: tuple = tuple(wanted)) -> None:
            nonlocal warned
            grad = p.grad
            if not isinstance(grad, DTensor) or tuple(grad.placements) == wanted:
                return
            if not warned:
                warned = True
                warnings.warn(
                    f"torch.compile(backend=\"spmd\"): the gradient of {fqn} came from eager DTensor code, not "
                    f"from a graph spmd_expand compiled (Dynamo ran part of the model eagerly: a graph break inside "
                    f"a torch.nn module runs that module's whole forward eagerly; TORCH_LOGS=graph_breaks shows "
                    f"where). Such gradients are reduced to the plan's placements after backward, one collective "
                    f"per parameter, neither bucketed nor overlapped",
                    stacklevel=2,
                )
            p.grad = grad.redistribute(mesh, wanted)

        param.register_post_accumulate_grad_hook(reduce)


def _refuse_recurrent_modules(model: nn.Module) -> None:
    """Refuse ``nn.RNN``/``LSTM``/``GRU`` modules while ``torch._dynamo.config.allow_rnn`` is off,
    before anything is converted.

    Without it Dynamo breaks the graph at them, so they run in eager DTensor, where oneDNN's fused RNN
    kernel (``mkldnn_rnn_layer``) has no sharding rule and the zero initial state ``forward`` creates
    is a plain tensor: the first call failed with DTensor's raw mixed-tensor error. With it Dynamo
    captures them, as torch's decomposition, which DTensor places.

    Raises:
        PlanError: naming the module and the fix.
    """
    if torch._dynamo.config.allow_rnn:
        return
    for fqn, module in model.named_modules():
        if isinstance(module, nn.RNNBase):
            raise PlanError(
                f"spmd.parallelize: {type(module).__name__} {fqn!r}: with torch._dynamo.config.allow_rnn off, "
                f"Dynamo breaks the graph at recurrent modules and runs them in eager DTensor, which cannot run "
                f"oneDNN's RNN kernel\n"
                f"  fix: set torch._dynamo.config.allow_rnn = True before spmd.parallelize (Dynamo then captures "
                f"the module as torch's decomposition), or compile the whole train step with spmd.compile"
            )


def _read_parameters_in_compute_placements(model: nn.Module, resolved: ResolvedPlan) -> None:
    """While Dynamo traces, a parameter stored sharded (FSDP) is read in its compute placements.

    Dynamo captures the model by running its DTensor code on fake tensors. On a parameter in its
    storage placements (``Shard(0)`` on the data-parallel dim), DTensor's eager rules pick layouts
    FSDP would never use (a Linear's output split on features over the data-parallel dim too) and
    can fail outright (a view that splits attention heads over both dims of a 2-D mesh). As
    SimpleFSDP does (Zhang et al., 2024, "SimpleFSDP: Simpler Fully Sharded Data Parallel with
    torch.compile"), each such parameter is read through a property of the module's class that
    redistributes it to its compute placements; outside compilation the property returns the
    parameter itself. The parameter stays registered where it was: the same FQNs, ``state_dict``
    and optimizer. In our own graph the redistribution is an identity (:class:`_GlobalView`): the
    plan's ``unshard`` places the parameter, as in ``spmd.compile``.
    """
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    for module in model.modules():
        views = {}
        for name, param in module._parameters.items():
            if param is None or id(param) not in fqn_of:
                continue
            compute = resolved.compute_placements(fqn_of[id(param)], param)
            if tuple(param.placements) != compute:
                views[name] = _compute_view(name, compute)
        if views:
            cls = type(module)
            if isinstance(module, nn.RNNBase):
                views.update(_RNN_COMPUTE_WEIGHTS)
            module.__class__ = type(cls.__name__, (cls,), {**views, "__module__": cls.__module__})


def _warn_about_kv_cache(model: nn.Module, resolved: ResolvedPlan) -> None:
    """HuggingFace models build a KV cache in forward by ``torch.cat`` onto an empty plain tensor;
    DTensor's ``cat`` rule (which Dynamo runs while capturing) cannot place that tensor next to
    head-sharded keys and fails with "Dimension out of range". ``spmd.compile`` handles it."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and any(isinstance(s, TensorParallel) for s in resolved.styles):
        warnings.warn(
            "spmd.parallelize: model.config.use_cache is True under tensor parallelism; torch.compile(backend=\"spmd\") "
            "cannot capture the KV cache HuggingFace builds in forward. Training does not need it: set "
            "model.config.use_cache = False or call the model with use_cache=False",
            stacklevel=2,
        )


def _flat_weights(module: nn.RNNBase) -> list:
    if torch.compiler.is_compiling():
        return [getattr(module, name, None) for name in module._flat_weights_names]
    return module.__dict__["_flat_weights"]


def _set_flat_weights(module: nn.RNNBase, weights: list) -> None:
    module.__dict__["_flat_weights"] = weights


def _update_flat_weights(module: nn.RNNBase) -> None:
    if not torch.compiler.is_compiling():
        nn.RNNBase._update_flat_weights(module)


# nn.LSTM / GRU / RNN compute with ``self._flat_weights``, a list of their parameters it refreshes when
# ``getattr`` returns other tensors than last time, which the compute views always do: each call
# rebuilt the list inside the graph and Dynamo compiled a second time on the weak references it
# keeps. While compiling, the list is read from the compute views, with no refresh.
_RNN_COMPUTE_WEIGHTS = {
    "_flat_weights": property(_flat_weights, _set_flat_weights),
    "_update_flat_weights": _update_flat_weights,
}


def _compute_view(name: str, placements: tuple) -> property:
    def read(module: nn.Module) -> torch.Tensor:
        param = module._parameters[name]
        if torch.compiler.is_compiling():
            return param.redistribute(param.device_mesh, placements)
        return param

    return property(read)


def _require_compiling() -> None:
    """A parallelized model's forward runs only inside a graph Dynamo captures (and our backend compiles).

    Run eagerly (no ``torch.compile``, or Dynamo falling back to eager for a frame after its recompile
    limit), ``to_local`` would give each rank's loss a gradient summed over the data-parallel ranks
    instead of averaged: refuse.
    """
    if not torch.compiler.is_compiling():
        raise SpmdError(
            "a model from spmd.parallelize ran eagerly; run it as torch.compile(model, backend=\"spmd\", "
            "options={\"mesh\": mesh, \"plan\": plan}). If it is compiled: Dynamo ran a frame eagerly, e.g. "
            "after torch._dynamo.config.recompile_limit recompilations of it (raise the limit); eager DTensor "
            "execution would sum, not average, the data-parallel ranks' gradients"
        )


def _replicate_plain_tensors_while_tracing() -> None:
    """While Dynamo traces, a plain tensor meeting a DTensor is taken as replicated, and shapes stay static.

    Tensors a forward creates itself (``torch.arange`` positions, causal masks) are the same on every
    rank, which is what ``Replicate`` means; DTensor refuses the mix unless its implicit replication
    is on (``torch.distributed.tensor.experimental.implicit_replication``). Dynamo's compile start/end
    callbacks turn it on for the duration of each compilation only; the batch itself enters through
    :func:`parallelize`'s hook with its real placements. Dynamo's automatic dynamic shapes are off
    during compilations too: ``nn.Module.__call__`` is one code object for every module, so a second
    model (or a new batch shape) would otherwise make sizes symbolic, which the stages do not take.

    Idempotent; ``torch._dynamo.reset()`` drops the callbacks, and the next :func:`parallelize` call
    installs them again.
    """
    from torch._dynamo.callback import callback_handler

    if _on_compile_start in callback_handler.start_callbacks:
        return
    callback_handler.register_start_callback(_on_compile_start)
    callback_handler.register_end_callback(_on_compile_end)


_SAVED_TRACING_FLAGS: list[tuple[bool, bool, bool]] = []


def _on_compile_start(_args) -> None:
    _SAVED_TRACING_FLAGS.append(
        (torch._C._get_dtensor_allow_implicit_replication(), torch._dynamo.config.automatic_dynamic_shapes, torch._C._get_mkldnn_enabled())
    )
    torch._C._set_dtensor_allow_implicit_replication(True)
    # Our stages compile static shapes: a new shape is a new graph, never a symbolic size.
    torch._dynamo.config.automatic_dynamic_shapes = False
    # An LSTM on CPU is then captured as torch's decomposition into matmuls and pointwise ops, which
    # DTensor places, not as oneDNN's fused layer (mkldnn_rnn_layer), which it cannot (as spmd.compile
    # traces it).
    torch._C._set_mkldnn_enabled(False)


def _on_compile_end(_args) -> None:
    implicit, automatic, onednn = _SAVED_TRACING_FLAGS.pop() if _SAVED_TRACING_FLAGS else (False, True, True)
    torch._C._set_dtensor_allow_implicit_replication(implicit)
    torch._dynamo.config.automatic_dynamic_shapes = automatic
    torch._C._set_mkldnn_enabled(onednn)


# ---------------------------------------------------------------------------------------------- backend


@dataclass
class BackendStats:
    """Counters of :func:`spmd_backend` in this process (tests count compilations with them)."""

    graphs_compiled: int = 0
    backwards_compiled: int = 0


stats = BackendStats()
_stats_lock = threading.Lock()

_OPTIONS = {
    "mesh": "the DeviceMesh given to spmd.parallelize",
    "plan": "the plan given to spmd.parallelize",
    "passes": '"default", or a list of pass names / pass objects (as spmd.compile)',
    "lower": f"one of {LOWERINGS}",
}


def spmd_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Optional[dict] = None) -> Callable:
    """The ``spmd`` Dynamo backend: compile one captured graph of a :func:`parallelize`-d model.

    ``options`` (``torch.compile(..., options={...})``): ``mesh`` and ``plan`` (checked against
    :func:`parallelize`'s), ``passes`` (default ``"default"``), ``lower`` (``"inductor"`` or ``"eager"``).

    Returns a callable over the graph's inputs (DTensor parameters, local batch tensors) returning its
    outputs (local tensors where the graph ends in ``to_local``, DTensors elsewhere).

    Raises:
        TraceError: a parameter or buffer is still on the meta device (``to_empty`` and initialize).
        SpmdError: an unknown option, a mesh or plan that is not the model's, a graph that reads
            parameters of no parallelized model, or a construct the backend cannot read (a local
            tensor computed on after ``to_local``, dynamic shapes).
        TraceError, UnsupportedOpError, PlacementError, PassError: from the stage that failed.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in _OPTIONS.items())
        raise SpmdError(f"torch.compile(backend=\"spmd\"): unknown option(s) {unknown}; the options are {known}")
    lower = options.get("lower", "inductor")
    if lower not in LOWERINGS:
        raise SpmdError(f"torch.compile(backend=\"spmd\"): option lower={lower!r} is not one of {LOWERINGS}")
    model, info = _owner(example_inputs, options)
    broadcast_materialized_state(model, info.mesh, "torch.compile(backend=\"spmd\")")
    for name in ("mesh", "plan"):
        if name in options and not _same_setting(options[name], getattr(info, name)):
            raise SpmdError(
                f"torch.compile(backend=\"spmd\"): option {name!r} is not the {name} the model was parallelized "
                f"with (spmd.parallelize(model, mesh, plan)); pass an equal one or leave the option out"
            )
    global_passes, local_passes = resolve_passes(options.get("passes", "default"))
    # Our stages make their own fake modes; Dynamo's tracing context (and its fake mode) stays outside.
    with torch._guards.tracing(None):
        compiled = _GraphCompiler(gm, list(example_inputs), model, info, global_passes, local_passes, lower).compile()
    with _stats_lock:
        stats.graphs_compiled += 1
    return compiled


def _same_setting(a: Any, b: Any) -> bool:
    """The same mesh or plan: the same object, or an equal one (``spmd.DDP() == spmd.DDP()``)."""
    return a is b or a == b


def _owner(example_inputs: Sequence[Any], options: dict) -> tuple[nn.Module, _Parallelized]:
    """The parallelized model whose parameters the graph reads.

    A graph without parameters (e.g. the part of a forward before a graph break, or a module hook
    Dynamo compiles apart from the ``forward``) belongs to the model parallelized with ``options``' mesh and
    plan objects (else with equal ones), or to the only parallelized model of the process.
    """
    ids = {id(t) for t in example_inputs if isinstance(t, nn.Parameter)}
    models = list(_PARALLELIZED.items())
    if ids:
        owners = [(m, info) for m, info in models if ids & {id(p) for p in m.parameters()}]
    else:

        def parallelized_with(same: Callable[[Any, Any], bool]) -> list:
            return [
                (m, info)
                for m, info in models
                if same(options.get("mesh", info.mesh), info.mesh) and same(options.get("plan", info.plan), info.plan)
            ]

        # The model parallelized with these very objects, else with equal ones.
        owners = parallelized_with(operator.is_) or parallelized_with(_same_setting)
        if len(owners) > 1:
            raise SpmdError(
                f"torch.compile(backend=\"spmd\"): a graph that reads no parameters (the part of a forward after "
                f"a graph break, or a hook Dynamo compiles apart) matches {len(owners)} parallelized models "
                f"({', '.join(type(m).__name__ for m, _ in owners)}), parallelized with the same mesh and plan: "
                f"spmd_expand cannot tell which model it belongs to. Give each model its own plan object "
                f"(spmd.parallelize(model_b, mesh, spmd.DDP()) with a new spmd.DDP(), and the same object in "
                f"its torch.compile options), or drop the references to models no longer used"
            )
    if len(owners) != 1:
        what = "reads parameters of" if ids else "reads no parameters and matches"
        raise SpmdError(
            f"torch.compile(backend=\"spmd\"): the graph {what} "
            + ("no model given to spmd.parallelize" if not owners else f"{len(owners)} parallelized models")
            + "; call model = spmd.parallelize(model, mesh, plan) before torch.compile(model, backend=\"spmd\", "
            "options={\"mesh\": mesh, \"plan\": plan})"
        )
    return owners[0]


@dataclass
class _Slot:
    """One placeholder of the Dynamo graph: ``kind`` in {param, buffer, input, constant}."""

    kind: str
    fqn: str = ""
    placements: tuple = ()
    global_spec: Optional[TensorSpec] = None
    requires_grad: bool = False


@dataclass
class _Output:
    """One output of the Dynamo graph: returned ``local`` (after ``to_local``), as a ``dtensor``, or ``plain``."""

    kind: str
    placements: tuple
    shape: torch.Size
    stride: tuple
    differentiable: bool
    tangent_placements: tuple = ()
    tangent_scale: float = 1.0


def _is_from_local(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is DTensor.from_local


def _source_line(node: fx.Node) -> str:
    """`` (at File "...", line N, in fn: code)``: the innermost frame of the user's code in the node's
    stack trace (not torch's or spmd_expand's own); empty without a stack trace."""
    return f" (at {user_source_line(node)})" if node.meta.get("stack_trace") else ""


class _GlobalView(fx.Interpreter):
    """Run a Dynamo graph of DTensor code on plain global tensors: the single-device program.

    ``from_local``/``to_local`` are identities. A ``redistribute`` (a tensor-parallel style's module
    boundary, the batch layout of a result) becomes ``spmd_expand::layout`` markers, one per mesh dim
    it brings to ``Replicate``/``Shard``, so propagation honours it as in ``spmd.compile``.
    """

    def call_function(self, target, args, kwargs):
        if target is DTensor.from_local:
            return args[0]
        return super().call_function(target, args, kwargs)

    def call_method(self, target, args, kwargs):
        if target in ("to_local", "full_tensor"):
            return args[0]
        if target == "redistribute":
            value = args[0]
            if self._node.args[0] in self.parameters:
                return value  # a parameter read in its compute placements: ``unshard`` places it

            placements = kwargs.get("placements", args[2] if len(args) > 2 else None)
            before = self._node.args[0].meta["example_value"].placements
            for mesh_dim, placement in enumerate(placements or ()):
                # Only the mesh dims it changes (a marker elsewhere could split e.g. a vocab-parallel
                # embedding's masked partial sum from its mask).
                if type(placement) in (Replicate, Shard) and placement != before[mesh_dim]:
                    value = ops.layout(value, mesh_dim, encode_placement(placement, "redistribute"))
            return value
        return super().call_method(target, args, kwargs)

    def __init__(self, gm: fx.GraphModule, parameters: frozenset):
        super().__init__(gm)
        self.parameters = parameters  # the placeholders of the model's parameters

    def run_node(self, n: fx.Node) -> Any:
        self._node = n
        return super().run_node(n)


class _GraphCompiler:
    """Compile one Dynamo graph: read its inputs and outputs (``_slots``, ``_outputs``), build the
    roles/specs/placements our stages take, run them (:func:`~spmd_expand.pipeline.expand_joint`)
    and wrap the result in a :class:`_Runtime`."""

    def __init__(self, gm, example_inputs, model, info, global_passes, local_passes, lower):
        self.gm = gm
        self.example_inputs = example_inputs
        self.model = model
        self.info = info
        self.mesh: DeviceMesh = info.mesh
        self.plan: ResolvedPlan = info.resolved
        self.global_passes = global_passes
        self.local_passes = local_passes
        self.lower = lower
        self.dp_size = math.prod(self.mesh.size(d) for d in self.plan.data_parallel_dims)
        # What checks across ranks (the same on every rank) and log lines (with this rank) name this graph by.
        self.name = f"a {type(model).__qualname__} graph of torch.compile"
        self.what = describe_compilation(self.name, self.mesh)

    # ------------------------------------------------------------------ reading the Dynamo graph
    def _slots(self) -> list[_Slot]:
        fqn_of = {id(p): ("param", fqn) for fqn, p in self.model.named_parameters()}
        fqn_of.update({id(b): ("buffer", fqn) for fqn, b in self.model.named_buffers()})
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        slots = []
        for node, value in zip(placeholders, self.example_inputs):
            if isinstance(value, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(value, bool):
                raise SpmdError(
                    f"torch.compile(backend=\"spmd\"): graph input {node.target} is a dynamic size; compile with "
                    f"torch.compile(..., dynamic=False) (a new batch shape then compiles a new graph)"
                )
            if not isinstance(value, torch.Tensor):
                slots.append(_Slot("constant"))
                continue
            kind, fqn = fqn_of.get(id(value), ("input", ""))
            if isinstance(value, DTensor):
                placements = tuple(value.placements)
                shape = tuple(value.shape)
            else:
                users = list(node.users)
                if not users or not all(_is_from_local(u) for u in users):
                    other = next((u for u in users if not _is_from_local(u)), node)
                    raise SpmdError(
                        f"torch.compile(backend=\"spmd\"): graph input {node.target} is a plain tensor used by "
                        f"{getattr(other.target, '__name__', other.target)}{_source_line(other)}, not by a model from "
                        f"spmd.parallelize; pass local tensors to the parallelized model and compute on its results "
                        f"outside the compiled region. (A plain tensor the forward itself builds in code Dynamo does "
                        f"not compile, e.g. `z = torch.zeros(n, d); z[:] = h` under torch._dynamo.disable, is one too: "
                        f"build it from a DTensor there, `z = torch.zeros_like(h)`, or in compiled code.)"
                    )
                dt = users[0].meta["example_value"]
                placements = tuple(dt.placements)
                shape = tuple(dt.shape)
            spec = TensorSpec(shape, value.dtype, value.device)
            slots.append(_Slot(kind, fqn, placements, spec, kind == "input" and value.requires_grad))
        return slots

    def _outputs(self) -> list[_Output]:
        outputs = []
        grad_on = torch.is_grad_enabled()
        for node in self.gm.graph.output_node().args[0]:
            if not isinstance(node, fx.Node) or not isinstance(node.meta.get("example_value"), torch.Tensor):
                raise SpmdError(f"torch.compile(backend=\"spmd\"): the graph returns {node!r}; only tensors are supported")
            value = node.meta["example_value"]
            differentiable = grad_on and value.requires_grad and value.dtype.is_floating_point
            if node.op == "call_method" and node.target == "to_local":
                dt = node.args[0].meta["example_value"]
                out = _Output("local", tuple(dt.placements), dt.shape, tuple(dt.stride()), differentiable)
                # Per-rank losses, averaged over the data-parallel ranks (DDP's convention).
                out.tangent_placements = tuple(
                    Partial() if isinstance(style, _DataParallel) and isinstance(p, Replicate) else p
                    for style, p in zip(self.plan.styles, out.placements)
                )
                out.tangent_scale = 1.0 / self.dp_size
            elif isinstance(value, DTensor):
                # A partial value (a sum over the batch crossing a graph break) leaves the graph reduced:
                # eager code between graphs may read it as a number (`.item()`, `float()`), which on a
                # Partial DTensor gives this rank's part. Its gradient is replicated too, as DTensor's
                # autograd hands it back.
                reduced = tuple(Replicate() if p.is_partial() else p for p in value.placements)
                out = _Output("dtensor", reduced, value.shape, tuple(value.stride()), differentiable)
                out.tangent_placements = reduced
            else:
                out = _Output("plain", replicate(self.mesh), value.shape, tuple(value.stride()), differentiable)
                out.tangent_placements = out.placements
            outputs.append(out)
        for node in self.gm.graph.nodes:
            if node.op == "call_method" and node.target == "to_local":
                others = [u for u in node.users if u.op != "output"]
                if others:
                    raise SpmdError(
                        f"torch.compile(backend=\"spmd\"): the compiled region computes on a local tensor after "
                        f"to_local(){_source_line(others[0])}; compute the loss outside the compiled model, or keep "
                        f"the value a DTensor"
                    )
        return outputs

    # ------------------------------------------------------------------ compile
    def _refuse_dtensor_code_in_subgraphs(self) -> None:
        """A higher-order op's body (``torch.utils.checkpoint``'s ``tag_activation_checkpoint``) runs
        through the op's own interpreter, where :class:`_GlobalView` cannot turn its DTensor calls
        (a sharded parameter's ``redistribute`` to its compute placements, a module boundary's) into
        the single-device program: refused, naming the op and the fix, instead of failing inside it."""
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
                continue
            for arg in node.args:
                body = getattr(self.gm, arg.target, None) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
                if not isinstance(body, fx.GraphModule):
                    continue
                calls = [n for n in body.graph.nodes if (n.op == "call_method" and n.target in ("redistribute", "to_local"))
                         or (n.op == "call_function" and n.target is DTensor.from_local)]
                if calls:
                    raise SpmdError(
                        f"torch.compile(backend=\"spmd\"): {node.target.__name__}{_source_line(node)} wraps code that "
                        f"reads parameters in other placements than they are stored in ({calls[0].target} in its "
                        f"body); a region under torch.utils.checkpoint is compiled here only where it does not "
                        f"(a DDP plan)\n  fix: compile the whole step with spmd.compile, which takes activation "
                        f"checkpointing under every plan, or leave torch.utils.checkpoint out of the compiled model"
                    )

    def compile(self) -> Callable:
        self._refuse_dtensor_code_in_subgraphs()
        outputs = self._outputs()
        slots = self._slots()
        diff_outputs = [i for i, o in enumerate(outputs) if o.differentiable]
        grad_inputs = [i for i, s in enumerate(slots) if s.kind == "input" and s.requires_grad]
        joint = bool(diff_outputs)

        roles, specs, placements, locals_ = [], [], [], []
        for slot, value in zip(slots, self.example_inputs):
            if slot.kind in ("param", "buffer"):
                roles.append(InputRole(slot.kind, slot.fqn))
                specs.append(slot.global_spec)
                placements.append(slot.placements)
                locals_.append(value.to_local() if isinstance(value, DTensor) else value)
        batch = 0
        for slot, value in zip(slots, self.example_inputs):
            if slot.kind == "input":
                roles.append(InputRole("batch", key=str(batch)))
                specs.append(slot.global_spec)
                placements.append(slot.placements)
                locals_.append(value.to_local() if isinstance(value, DTensor) else value)
                batch += 1
        if joint:
            for i in diff_outputs:
                out = outputs[i]
                roles.append(InputRole("batch", key=str(batch)))
                value = self.gm.graph.output_node().args[0][i].meta["example_value"]
                specs.append(TensorSpec(tuple(out.shape), value.dtype, value.device))
                placements.append(out.tangent_placements)
                local = value.to_local() if isinstance(value, DTensor) else value
                locals_.append(torch.empty(local.shape, dtype=local.dtype, device=local.device))
                batch += 1

        step = _joint_step(self.gm, slots, self.example_inputs, outputs, diff_outputs, grad_inputs)
        params = dict(self.model.named_parameters())

        def out_placements(traced: TracedStep) -> list:
            result = []
            returns = [o.placements for o in outputs] + [slots[i].placements for i in grad_inputs]
            returns = [p for p, present in zip(returns, traced.return_is_tensor) if present]
            it = iter(returns)
            for role in traced.outputs:
                if role.kind == "return":
                    result.append(next(it))
                else:
                    result.append(self.plan.grad_placements(role.fqn, params[role.fqn]) or replicate(self.mesh))
            return result

        n_state = sum(s.kind in ("param", "buffer") for s in slots)
        what, began = self.what, time.perf_counter()
        log.info("compiling %s (%d nodes; trace, propagate, expand, passes; lowered on its first call)", what, len(self.gm.graph.nodes))
        artifacts = expand_joint(
            step,
            (self.model, *locals_[n_state:]),
            {},
            self.model,
            None,
            roles,
            specs,
            placements,
            locals_,
            mesh=self.mesh,
            plan=self.plan,
            timeout=self.info.timeout,
            grad_placements=lambda fqn: self.plan.grad_placements(fqn, params[fqn]),
            gradient_sync=True,
            global_passes=self.global_passes,
            local_passes=self.local_passes,
            module_override=(),
            redistribute_cache=RedistributeCache(),
            out_placements=out_placements,
            parameter_hooks=False,  # eager autograd runs them on the DTensor gradients this returns
            warn_trace_time_python=False,  # Dynamo runs the forward's Python (a print) on every call
            num_tangents=len(diff_outputs) if joint else 0,
            num_forward_outputs=len(outputs),
        )
        log.info("expanded %s in %.1f s (%s s)", what, time.perf_counter() - began, stage_seconds(artifacts.step.seconds))
        return _Runtime.build(self, artifacts, slots, outputs, diff_outputs, grad_inputs)


def _joint_step(gm, slots, example_inputs, outputs, diff_outputs, grad_inputs) -> Callable:
    """The single-device program of ``gm``, forward and (with tangents) backward, for ``trace_step``.

    ``step(model, *batch)``: ``batch`` holds the graph's non-parameter tensor inputs (global), then one
    tangent per differentiable output. Returns the graph's outputs, then the gradients of inputs that
    require grad; parameter gradients are left in ``.grad`` (trace_step makes them outputs).
    """
    n_inputs = sum(s.kind == "input" for s in slots)

    def step(model: nn.Module, *batch: torch.Tensor) -> list:
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        inputs, tangents = list(batch[:n_inputs]), list(batch[n_inputs:])
        values, it, leaves = [], iter(inputs), []
        for slot, example in zip(slots, example_inputs):
            if slot.kind == "param":
                values.append(params[slot.fqn])
            elif slot.kind == "buffer":
                values.append(buffers[slot.fqn])
            elif slot.kind == "input":
                value = next(it)
                if slot.requires_grad:
                    value = value.detach().requires_grad_()
                    leaves.append(value)
                values.append(value)
            else:
                values.append(example)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        parameters = frozenset(n for n, slot in zip(placeholders, slots) if slot.kind == "param")
        results = list(_GlobalView(gm, parameters).run(*values))
        if not tangents:
            return results + [None] * len(leaves)
        # torch.autograd.grad, not backward(): gradients are returned as computed, without
        # AccumulateGrad's copies into the leaves' layouts.
        # Only this graph's parameters (the model's others are not traced here and keep their .grad).
        trainable = [params[s.fqn] for s in slots if s.kind == "param" and params[s.fqn].requires_grad]
        grads = torch.autograd.grad(
            [results[i] for i in diff_outputs],
            trainable + leaves,
            [t * outputs[i].tangent_scale if outputs[i].tangent_scale != 1.0 else t for i, t in zip(diff_outputs, tangents)],
            allow_unused=True,
        )
        for p, g in zip(trainable, grads):
            if g is not None:
                p.grad = g
        return results + list(grads[len(trainable):])
    return step


class _Runtime:
    """The compiled graph at run time: local tensors in, forward and backward graphs, DTensors out."""

    def __init__(self, compiler, artifacts: JointArtifacts, slots, outputs, diff_outputs, grad_index):
        self.mesh = compiler.mesh
        self.lower = compiler.lower
        self.what = compiler.what  # for log lines
        self.name = compiler.name  # for the per-call check across ranks (check_call)
        self.timeout = compiler.info.timeout
        # Dynamo's guards run on each rank alone: a rank whose guards fail (a batch of another shape
        # there only, another train()/eval() mode) compiles a new graph while the others run the one
        # compiled before, and the others' collectives would wait for it until the process group's
        # timeout. Each call after the first (its compilation checked every rank's graph) checks across
        # ranks which graph runs, on which batch shapes, and for a graph that draws random numbers, the
        # generator state (each rank keeps its slice of one draw from its own default generator, rng.py;
        # code between calls can draw on some ranks only: `if rank == 0: torch.rand(...)`). The check
        # shares rank_check's serials with compilation's checks, so a rank at a call meets a rank that
        # compiles at once, as a DivergenceError on both. A graph with no collective and no draw needs
        # none: a rank that compiled it meets the others at their next check.
        step = artifacts.step
        graphs = [artifacts.forward] + ([artifacts.backward] if artifacts.backward is not None else [])
        self._checks_calls = step.draws_random or any(
            n.op == "call_function" and n.target in COLLECTIVES for gm in graphs for n in gm.graph.nodes
        )
        self._draws = step.draws_random
        self._call_entries = [f"compiled graph {step.graph_digest:08x}"] + [
            f"batch input {k}: {str(s.global_spec.dtype).removeprefix('torch.')}{list(s.global_spec.shape)} {tuple(s.placements)}"
            for k, s in enumerate(s for s in slots if s.kind == "input")
        ]
        self._calls = 0
        self.ran_passes = frozenset(r.name for r in artifacts.step.passes)
        # Dynamo guards the Python this graph came from; the trace's own guards (spmd.compile's, which
        # hold the model's modules) are not read here, and kept they would keep the model alive as long
        # as Dynamo's compiled code, a global of the forward's module that torch._dynamo.reset() leaves.
        artifacts.step.traced.python_guards = PythonGuards()
        self.artifacts = artifacts
        self.tensor_positions = [i for i, s in enumerate(slots) if s.kind in ("param", "buffer")] + [
            i for i, s in enumerate(slots) if s.kind == "input"
        ]
        self.outputs = outputs
        self.diff_outputs = diff_outputs
        self.joint = artifacts.backward is not None
        self.forward_gm = artifacts.forward
        self.backward_gm = artifacts.backward
        self.grad_index = grad_index  # per tensor argument: index among the backward outputs, or None
        self._forward: Optional[Callable] = None
        self._backward: Optional[Callable] = None
        self._reached: dict[frozenset, frozenset] = {}

    def gradients_reached(self, present: frozenset) -> frozenset:
        """The backward graph's outputs that depend on a tangent in ``present`` (indices among the
        differentiable outputs). The others are gradients of outputs that no loss used: zero, where
        eager autograd computes none (the parameter's ``.grad`` stays None; an optimizer skips it).
        Read off the traced single-device graph: the local one joins every gradient in its buckets."""
        if present not in self._reached:
            traced = self.artifacts.step.traced
            graph = traced.graph_module.graph
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            n_roles = len(traced.inputs)  # the tangents are the last inputs (expand_joint's roles)
            tangents = placeholders[n_roles - len(self.diff_outputs):n_roles]
            live = {t for j, t in enumerate(tangents) if j in present}
            for node in graph.nodes:
                if node.op != "placeholder" and any(i in live for i in node.all_input_nodes):
                    live.add(node)
            returned = graph.output_node().args[0][len(self.outputs):]
            self._reached[present] = frozenset(
                k for k, v in enumerate(returned) if isinstance(v, torch.fx.Node) and v in live
            )
        return self._reached[present]

    @classmethod
    def build(cls, compiler, artifacts: JointArtifacts, slots, outputs, diff_outputs, grad_inputs) -> "_Runtime":
        traced = artifacts.step.traced
        if artifacts.backward is None:
            return cls(compiler, artifacts, slots, outputs, diff_outputs, [])
        backward_roles = traced.outputs[len(outputs):]
        present = iter(traced.return_is_tensor[len(outputs):])
        input_grads = [i for i in grad_inputs if next(present)]
        position = {("input", i): k for k, i in enumerate(input_grads)}
        position.update({("param", r.fqn): k for k, r in enumerate(backward_roles) if r.kind == "grad"})
        tensor_slots = [i for i, s in enumerate(slots) if s.kind in ("param", "buffer")] + [
            i for i, s in enumerate(slots) if s.kind == "input"
        ]
        grad_index = [
            position.get(("param", slots[i].fqn)) if slots[i].kind == "param" else position.get(("input", i))
            for i in tensor_slots
        ]
        return cls(compiler, artifacts, slots, outputs, diff_outputs, grad_index)

    @cyclic_gc_paused()  # as spmd.compile's compile_step: lowering runs on the first call of each graph
    def _lowered(self, gm: fx.GraphModule, inputs: Sequence[torch.Tensor], which: str) -> Callable:
        began = time.perf_counter()
        lowered = lower_graph(gm, list(inputs), self.lower, ran_passes=self.ran_passes, mesh=self.mesh)
        log.info("lowered the %s graph of %s (%s) in %.1f s", which, self.what, self.lower, time.perf_counter() - began)
        return lowered

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> list:
        if self._forward is None:
            self._forward = self._lowered(self.forward_gm, tensors, "forward")
        return list(self._forward(*tensors))

    def run_backward(self, inputs: Sequence[torch.Tensor]) -> list:
        if self._backward is None:
            self._backward = self._lowered(self.backward_gm, inputs, "backward")
            with _stats_lock:
                stats.backwards_compiled += 1
        return list(self._backward(*inputs))

    def check_call(self) -> None:
        """Before a call of this graph (not the first: its compilation checked): every rank of the mesh
        runs this graph, on the same global batch shapes, and where it draws random numbers, from the
        same generator state. One store round trip (about 0.4 ms on 2 CPU ranks).

        Raises:
            DivergenceError: on every rank, before the graph runs, where a rank compiles another graph
                (its Dynamo guards failed alone: a batch of another shape, another train()/eval() mode),
                runs another graph, or draws from another generator state (a seed per rank, a draw on
                some ranks only between calls), naming what differs on each side.
        """
        entries = self._call_entries + ([f"random generator state: {generator_state(self.mesh.device_type)}"] if self._draws else [])
        generator_line = len(self._call_entries)
        check_ranks_agree(
            f"a call of {self.name}", entries, [""] * len(entries), self.mesh, self.timeout,
            fix=lambda index: GENERATOR_FIX if index == generator_line else CALL_FIX,
        )

    def __call__(self, *args: Any) -> tuple:
        self._calls += 1
        if self._checks_calls and self._calls > 1:
            self.check_call()
        tensors = [args[i] for i in self.tensor_positions]
        if self.joint:
            # DTensors go in as they are: one autograd node for the graph, not one to_local per parameter.
            results = _SpmdFunction.apply(self, *tensors)
        else:
            results = self.run_forward([t._local_tensor if isinstance(t, DTensor) else t for t in tensors])
        return tuple(self._wrap(value, out) for value, out in zip(results, self.outputs))

    def _wrap(self, value: torch.Tensor, out: _Output) -> torch.Tensor:
        if out.kind != "dtensor":
            return value
        return DTensor.from_local(value, self.mesh, out.placements, run_check=False, shape=out.shape, stride=out.stride)


class _SpmdFunction(torch.autograd.Function):
    """Forward and backward graphs of one compiled Dynamo graph, over this rank's local tensors."""

    @staticmethod
    def forward(ctx, runtime: _Runtime, *tensors: torch.Tensor):
        ctx.specs = [t._spec if isinstance(t, DTensor) else None for t in tensors]
        results = runtime.run_forward([t._local_tensor if isinstance(t, DTensor) else t for t in tensors])
        n = len(runtime.outputs)
        outs = tuple(results[:n])
        ctx.runtime = runtime
        ctx.saved = results[n:]
        # An output no loss used gets no gradient (None, not zeros): see _Runtime.gradients_reached.
        ctx.set_materialize_grads(False)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        nondiff = [o for o, spec in zip(outs, runtime.outputs) if not spec.differentiable]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return outs

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        runtime: _Runtime = ctx.runtime
        tangents = []
        for i in runtime.diff_outputs:
            g = grads[i]
            shape, dtype, device = ctx.out_meta[i]
            tangents.append(torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous())
        saved, ctx.saved = ctx.saved, None
        results = runtime.run_backward([*saved, *tangents])
        present = frozenset(j for j, i in enumerate(runtime.diff_outputs) if grads[i] is not None)
        # Every rank runs the whole graph (its collectives) above; a gradient of unused outputs only is
        # then none, as eager autograd gives none (AdamW would decay a parameter one device leaves alone).
        reached = runtime.gradients_reached(present) if len(present) < len(runtime.diff_outputs) else None
        grads = []
        for k, spec in zip(runtime.grad_index, ctx.specs):
            if k is None or (reached is not None and k not in reached):
                grads.append(None)
            elif spec is None:
                grads.append(results[k])
            else:  # the gradient of a DTensor input: this rank's shard, with the input's placements
                grads.append(DTensor(results[k], spec, requires_grad=False))
        return (None, *grads)
