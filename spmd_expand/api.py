"""``spmd.compile``: the user-facing entry point.

:class:`CompiledStep` finds the model and optimizer among the step's arguments, keeps their state as
DTensors, checks on every call what the compiled graph assumed (:mod:`spmd_expand.guards`), runs the
compiled graph and writes its results back. Compiling is :func:`spmd_expand.pipeline.compile_step`; the
conversion of the state to DTensors is :mod:`spmd_expand.state`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from . import optimizer_state
from .errors import BatchError, PassError, PlacementError, SpmdError, TraceError, UnsupportedOpError, first_line, user_source_line
from .expand import RedistributeCache
from .guards import (
    CallState, ObjectIds, PendingCheck, Snapshot, batch_problems, cache_key, check_batch, initialize_optimizer_state, is_dense,
    overlapping_batch_leaves, snapshot, start_check, value_digest,
)
from .lower import LOWERINGS
from .passes import resolve_passes
from .pipeline import Override, StepArtifacts, compile_step
from .prologue import PrologueRunner
from .rng import generator_state
from .plans import Plan, ResolvedPlan, resolve_plan
from .python_values import TensorConstant, argument_key, liftable
from .spec import AS_PRODUCED, replicate
from .state import adopt_replaced_parameters, broadcast_materialized_state, check_optimizer_params, distribute_state, refuse_eager_calls, unwrapped
from .trace import (
    FloatArgument, FloatConstant, HyperParameter, InputRole, TensorSpec, TracedStep, argument_labels, float_arguments, hyperparameters_of,
    step_float_constants,
    step_tensor_constants,
)
from .watch import as_timedelta, set_group_timeouts

__all__ = ["compile", "CompiledStep", "Override", "StepArtifacts"]


def _find(leaves: Sequence[Any], kind: type, what: str, at_most_one: bool) -> Optional[Any]:
    found = list({id(x): x for x in leaves if isinstance(x, kind)}.values())
    if len(found) > 1 or (not at_most_one and not found):
        if at_most_one:  # optimizers
            fix = (
                "one optimizer over all parameters when they step together; when they step at different "
                "points (a GAN's discriminator and generator updates), one compiled step per optimizer, each "
                "taking the model that holds every module and its own optimizer: d_step(gan, opt_d, real, z) "
                "and g_step(gan, opt_g, z), with gan = nn.ModuleDict({'G': G, 'D': D}) (the steps share the model)"
            )
        else:
            fix = "wrap several modules in one nn.Module (nn.ModuleDict({'G': G, 'D': D})) and pass that"
        raise TraceError(
            f"spmd.compile needs exactly one nn.Module and at most one torch.optim.Optimizer among the step's "
            f"arguments; found {len(found)} {what}\n  fix: {fix}"
        )
    return found[0] if found else None



class _Stale(Exception):
    """An input of the bound call is not what the graph was compiled for: take the full path."""


class _FloatInputsFailed(Exception):
    """Compiling with the step's float arguments as graph inputs failed (``error``): they may be read
    where a symbolic float cannot go; the call is made again with them as constants."""

    def __init__(self, error: SpmdError, float_args: Sequence[FloatArgument]):
        super().__init__(str(error))
        self.error = error
        self.float_args = list(float_args)


@dataclass
class _Binding:
    """The last call that went through the full path, and how to read its inputs again.

    A later call whose :class:`~spmd_expand.guards.Snapshot` equals ``snapshot`` (taken before that
    call ran) has the same cache key and input roles, and the same parameter, buffer and optimizer
    state objects (the snapshot holds them by identity), so their local tensors are reused as they
    are. Only gradients and the batch are read again: gradients are checked against the placements
    and shape the graph was compiled for.
    """

    snapshot: Snapshot
    artifacts: StepArtifacts
    resolved: ResolvedPlan
    local_template: list  # every graph tensor input's local tensor; None where read on every call
    gradients: list[tuple]  # (input index, parameter, placements, global shape)
    batch_inputs: list[tuple[int, int]]  # (input index, index among the batch tensors)
    batch: list[tuple]  # (shape, dtype, device, requires_grad) of every batch tensor
    constants: tuple
    gradient_sync: bool
    hyperparameters: list  # HyperParameter, then FloatArgument, then FloatConstant
    # (input index, TensorConstant, (shape, dtype, device)): read from its place on every call
    tensor_constants: list = dataclasses.field(default_factory=list)
    # The arguments' pytree structure: batch inputs are bound by leaf index, so a dict whose keys come
    # in another order (or keywords in another order) is another binding, not these tensors swapped.
    structure: Any = None

    def local_inputs(self, batch_leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = list(self.local_template)
        for index, leaf in self.batch_inputs:
            out[index] = batch_leaves[leaf]
        for index, constant, meta in self.tensor_constants:
            tensor = constant.read()
            if not liftable(tensor) or (tensor.shape, tensor.dtype, tensor.device) != meta:
                raise _Stale
            out[index] = tensor
        for index, param, placements, shape in self.gradients:
            grad = param.grad
            if type(grad) is not DTensor or grad.placements != placements or grad.shape != shape:
                raise _Stale
            out[index] = grad._local_tensor
        return out



@dataclass
class _Selection:
    """A full-path call's graph inputs and cache entry, chosen before the batch check (which compares
    the chosen graph across ranks) and used after it."""

    snapshot: Snapshot
    roles: list
    specs: list
    placements: list
    locals_: list
    tensor_constants: list  # TensorConstant, in the order of the graph's constant inputs
    compiled: list  # the cache entry: graphs compiled for this state
    artifacts: Optional[StepArtifacts]  # the one whose guards hold; None: compile one
    structure: Any = None  # the arguments' pytree structure (dict keys and their order, keywords)


class CompiledStep:
    """A train step compiled for a mesh and plan; call it like the original step."""

    def __init__(
        self,
        fn: Callable[..., Any],
        mesh: DeviceMesh,
        plan: Plan,
        lower: str = "inductor",
        passes: Union[str, Sequence[Any], None] = "default",
        module_override: Optional[Sequence[Override]] = None,
        keep_graphs: bool = False,
        timeout: Union[None, float, timedelta] = None,
    ):
        if lower not in LOWERINGS:
            raise SpmdError(f"lower={lower!r} is not one of {LOWERINGS}")
        self.timeout = as_timedelta(timeout, "timeout")
        if self.timeout is not None:
            set_group_timeouts(mesh, self.timeout)
        self.fn = fn
        # What the per-call exchange names this step by (the same on every rank).
        self._step_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self.mesh = mesh
        self.plan = plan
        self.lower = lower
        self.global_passes, self.local_passes = resolve_passes(passes)
        self.keep_graphs = keep_graphs
        self.module_override = list(module_override or [])
        # Cache key (see guards.cache_key) -> compilations for it, each valid where its
        # hyperparameter guards hold.
        self.cache: dict[tuple, list[StepArtifacts]] = {}
        self.redistribute_cache = RedistributeCache()
        self._resolved: Optional[ResolvedPlan] = None
        self._plans: "weakref.WeakKeyDictionary[nn.Module, ResolvedPlan]" = weakref.WeakKeyDictionary()
        self._ids = ObjectIds()
        self._state_attempted: "weakref.WeakKeyDictionary[torch.optim.Optimizer, set]" = weakref.WeakKeyDictionary()
        self.requires_gradient_sync = True
        self._binding: Optional[_Binding] = None
        # The batch shapes and dtypes graphs were compiled for, first seen first.
        self._batch_shapes: list[tuple] = []
        # Which Python floats are graph inputs: "all" (the step's float arguments, FloatArgument, and the
        # floats it reads from globals and attributes, FloatConstant), "arguments" or "none": a
        # compilation with them as inputs failed where one with their values did not.
        self._float_inputs = "all"
        # The name of each leaf of the arguments (trace.argument_labels), per argument structure.
        self._labels: dict[pytree.TreeSpec, list[str]] = {}
        functools.update_wrapper(self, fn)

    def reset(self) -> None:
        """Drop every compiled graph of this step: the next call traces and compiles again (the
        counterpart of ``torch.compiler.reset()`` for one compiled step; e.g. to time a compile).
        The model's and optimizer's distributed state is kept."""
        self.cache.clear()
        self.redistribute_cache = RedistributeCache()
        self._binding = None
        self._batch_shapes.clear()
        self._float_inputs = "all"

    # ------------------------------------------------------------------ gradient accumulation
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Turn gradient reduction off (``False``) for calls that only accumulate gradients.

        The FSDP2 habit (``FSDPModule.set_requires_gradient_sync``); :meth:`no_sync` is the DDP one.
        While off, gradients the step leaves in ``param.grad`` are not reduced: they are unreduced
        ``Partial`` DTensors of the full parameter shape (as FSDP2 keeps unsharded gradients). The
        next call with sync on reduces the accumulated gradient once, where the optimizer reads it.
        Do not call ``optimizer.step()`` inside a step run with sync off: it would update each rank
        with its own gradient, as with DDP's ``no_sync``.
        """
        self.requires_gradient_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: calls inside it accumulate gradients without reducing them (DDP's ``no_sync``)."""
        previous = self.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    # ------------------------------------------------------------------ state as DTensors
    def _distribute_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        distribute_state(model, optimizer, self.mesh, self._resolved, self.timeout)

    # ------------------------------------------------------------------ inputs
    def _inputs(self, model, optimizer, batch_leaves, tensor_constants: Sequence[TensorConstant] = ()):
        """(roles, global specs, placements, local tensors) of every graph input, in graph order:
        parameters, buffers, gradients, optimizer states, the batch, then the tensors the step reads
        from elsewhere (``tensor_constants``, replicated)."""
        plan = self._resolved
        roles, specs, placements, locals_ = [], [], [], []

        def add(role, global_shape, t, pl, dynamic=()):
            roles.append(role)
            specs.append(TensorSpec(tuple(global_shape), t.dtype, t.device, tuple(dynamic)))
            placements.append(tuple(pl))
            locals_.append(t.to_local() if isinstance(t, DTensor) else t)

        params = dict(model.named_parameters())
        for fqn, p in params.items():
            add(InputRole("param", fqn), p.shape, p, p.placements)
        for fqn, b in model.named_buffers():
            add(InputRole("buffer", fqn), b.shape, b, replicate(self.mesh))
        for fqn, p in params.items():
            if p.grad is not None:
                add(InputRole("grad", fqn), p.grad.shape, p.grad, p.grad.placements)
        if optimizer is not None:
            found = optimizer_state.holders(optimizer)
            for fqn, p in params.items():
                for key, v in optimizer_state.param_state(optimizer, p, found).items():
                    if isinstance(v, DTensor):
                        add(InputRole("state", fqn, key), v.shape, v, v.placements)
        for i, t in enumerate(batch_leaves):
            pl = plan.batch_placements(t)
            shape = list(t.shape)
            dynamic = []
            for mesh_dim, p in enumerate(pl):
                if isinstance(p, Shard):
                    shape[p.dim] *= self.mesh.size(mesh_dim)
                    dynamic.append(p.dim)
            # Size-0/1 dims are specialized by the shape env; they cannot be symbolic.
            dynamic = [d for d in dynamic if shape[d] >= 2]
            add(InputRole("batch", key=str(i)), shape, t, pl, dynamic)
        for constant in tensor_constants:
            t = constant.read()
            add(InputRole("constant", key=constant.label), t.shape, t, replicate(self.mesh))
        return roles, specs, placements, locals_

    # ------------------------------------------------------------------ compile
    def _compile(
        self, args, kwargs, model, optimizer, roles, specs, placements, example_inputs, float_args, tensor_constants,
        grad_enabled: bool = True,
    ) -> StepArtifacts:
        params = dict(model.named_parameters())
        plan = self._resolved
        sync = self.requires_gradient_sync
        return compile_step(
            self.fn, args, kwargs, model, optimizer, roles, specs, placements, example_inputs,
            mesh=self.mesh,
            plan=plan,
            grad_placements=lambda fqn: plan.grad_placements(fqn, params[fqn]) if sync else AS_PRODUCED,
            gradient_sync=sync,
            global_passes=self.global_passes,
            local_passes=self.local_passes,
            module_override=self.module_override,
            redistribute_cache=self.redistribute_cache,
            lower=self.lower,
            keep_graphs=self.keep_graphs,
            timeout=self.timeout,
            float_args=float_args,
            tensor_constants=tensor_constants,
            grad_enabled=grad_enabled,
        )

    def prepare(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Make ``model``'s parameters (and ``optimizer``'s existing states) DTensors with the plan's
        placements now, as the first call would.

        Use it before loading a sharded checkpoint (``torch.distributed.checkpoint``, or
        ``set_state_dict``) into a model that has not run a step yet. Idempotent.

        A model built on the meta device gets meta DTensor parameters of this rank's local shapes
        (see :func:`distribute_state`): call ``model.to_empty(device=...)``, initialize or load, and
        build the optimizer before the first call.
        """
        model = unwrapped(model)
        if optimizer is not None:
            adopt_replaced_parameters(model, optimizer)
            check_optimizer_params(model, optimizer)
        if model not in self._plans:
            self._plans[model] = resolve_plan(self.plan, self.mesh, model)
        self._resolved = self._plans[model]
        self._distribute_state(model, optimizer)
        refuse_eager_calls(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            # An evaluation under torch.inference_mode(): the model's DTensor parameters, the optimizer
            # state and the compiled graph's caches made here must stay ordinary tensors (an inference
            # tensor can never be used by autograd or updated in place again), so the step runs outside
            # it; the batch, inference tensors or not, is only read.
            with torch.inference_mode(False), torch.no_grad():  # gradients stay off, as the caller has them
                return self(*args, **kwargs)
        try:
            return self._call(args, kwargs)
        except _FloatInputsFailed as first:
            failed = first
        # Traced as a symbolic float, a float reached code that needs a number (a numpy call, a format
        # string, a Python library): trace with the values. First those of the floats read from
        # globals and attributes (the step's float arguments stay inputs), then all; if that fails
        # too, its error is the step's own problem.
        before = self._float_inputs
        for level in ("arguments", "none") if before == "all" else ("none",):
            self._float_inputs = level
            try:
                result = self._call(args, kwargs)
            except _FloatInputsFailed as again:
                failed = again
                continue
            except SpmdError:
                self._float_inputs = before
                raise
            constants = [fa for fa in failed.float_args if level == "none" or isinstance(fa, FloatConstant)]
            names = ", ".join(fa.label for fa in constants)
            step_name = getattr(self.fn, "__name__", "the step")
            which = (
                f"{step_name}'s float arguments" if all(isinstance(fa, FloatArgument) for fa in constants)
                else f"the floats {step_name} takes and reads" if level == "none"
                else f"the floats {step_name} reads from globals and attributes"
            )
            warnings.warn(
                f"spmd.compile: {which} ({names}) are "
                f"constants of its graph, not inputs: traced as inputs, the step failed ({first_line(failed.error)}). "
                f"Each new value compiles again; where one changes every call, keep it a tensor "
                f"(`torch.tensor(value)`, an argument like the batch) or compute it inside the step",
                stacklevel=2,
            )
            return result
        raise AssertionError("unreachable: with no float inputs a compilation raises its own error")

    def _call(self, args: tuple, kwargs: dict) -> Any:
        grad_enabled = torch.is_grad_enabled()
        leaves, structure = pytree.tree_flatten((args, kwargs))
        model = unwrapped(_find(leaves, nn.Module, "modules", at_most_one=False))
        optimizer = _find(leaves, torch.optim.Optimizer, "optimizers", at_most_one=True)
        given = [x for x in leaves if isinstance(x, torch.Tensor)]
        batch_leaves = _in_traced_layout(given)
        labels = self._labels.get(structure)
        if labels is None:  # the names of the arguments' leaves: one signature read per structure
            labels = self._labels[structure] = argument_labels(self.fn, args, kwargs)
        float_args = float_arguments(leaves, labels) if self._float_inputs != "none" else []
        constants = self._constants(leaves, labels, {fa.position for fa in float_args})
        bound = self._bound_call(model, optimizer, batch_leaves, constants, leaves, structure)
        if bound is None:
            # Every full call: state loaded since the last call (e.g. by set_state_dict) may be plain tensors.
            self.prepare(model, optimizer)
            broadcast_materialized_state(model, self.mesh, "spmd.compile")
            if optimizer is not None:
                attempted = self._state_attempted.setdefault(optimizer, set())
                if initialize_optimizer_state(model, optimizer, attempted):
                    self._distribute_state(model, optimizer)
            # Floats the step reads from globals, closure variables and attributes are graph inputs too.
            float_constants = step_float_constants(self.fn, model, optimizer) if self._float_inputs == "all" else []
            hyperparameters = [*hyperparameters_of(optimizer), *float_args, *float_constants]
            values = [hp.read(optimizer, leaves) for hp in hyperparameters]
            selection = self._select(model, optimizer, batch_leaves, constants, hyperparameters, values, structure)
            selected = selection.artifacts if selection else None
            held = [(r.key, t) for r, t in zip(selection.roles, selection.locals_) if r.kind == "constant"] if selection else []
        else:
            self._resolved = self._binding.resolved
            hyperparameters, values = self._binding.hyperparameters, bound[2]
            selected = bound[0]
            held = [(constant.label, bound[1][index]) for index, constant, _ in self._binding.tensor_constants]
        # A new compilation (selected None) compares the generators when it checks its graph.
        generator = generator_state(self.mesh.device_type) if selected is not None and selected.draws_random else None
        graph = selected.graph_digest if selected is not None else None
        call = CallState(
            constants, hyperparameters, values, graph, model, optimizer, generator, check_values=bound is None,
            step=self._step_name, tensor_constants=tuple((label, value_digest(t)) for label, t in held),
        )
        if bound is None:
            check_batch(batch_leaves, self._resolved, self.mesh, call)
        # The step updates local shards in place; autograd must not track that.
        with torch.no_grad():
            if bound is not None:
                artifacts, locals_, values = bound
                _refuse_gradients_without_grad_mode(artifacts, grad_enabled)
                _refuse_writes_to_shared_arguments(artifacts.traced, given, labels, args, kwargs)
                self.last = artifacts
                outputs = _run_checked(
                    artifacts.runner, [*locals_, *values],
                    lambda count: start_check(batch_leaves, self._resolved, self.mesh, call, count),
                )
                result = self._write_back(artifacts.traced, outputs, model, optimizer, values)
            else:
                result = self._run(
                    args, kwargs, model, optimizer, batch_leaves, constants, hyperparameters, values, selection, grad_enabled, given
                )
            for i in self.last.traced.mutated_batch_leaves:
                if batch_leaves[i] is not given[i]:
                    given[i].copy_(batch_leaves[i])  # the step wrote the contiguous copy in place
        return result

    @staticmethod
    def _constants(leaves: Sequence[Any], labels: Sequence[str], float_positions: set[int]) -> tuple:
        """What the step's non-tensor arguments contribute to the cache key, ``name=value`` each
        (:func:`~spmd_expand.python_values.argument_key`); a float that is a graph input by its type."""
        return tuple(
            f"{labels[i]}=" + ("<float input>" if i in float_positions else argument_key(x))
            for i, x in enumerate(leaves)
            if not isinstance(x, (torch.Tensor, nn.Module, torch.optim.Optimizer))
        )

    def _bound_call(self, model, optimizer, batch_leaves, constants, leaves, structure) -> Optional[tuple]:
        """(artifacts, local inputs, hyperparameter values) when this call matches the last full one
        (:class:`_Binding`) and its graph's guards hold; else None (take the full path)."""
        binding = self._binding
        if (
            binding is None
            or binding.gradient_sync != self.requires_gradient_sync
            or binding.structure != structure
            or binding.constants != constants
            or len(binding.batch) != len(batch_leaves)
            or any((t.shape, t.dtype, t.device, t.requires_grad) != b for t, b in zip(batch_leaves, binding.batch))
            or not snapshot(model, optimizer).same_as(binding.snapshot)
        ):
            return None
        try:
            locals_ = binding.local_inputs(batch_leaves)
        except _Stale:
            return None
        try:
            values = [hp.read(optimizer, leaves) for hp in binding.hyperparameters]
        except LookupError:  # a float input's place holds something else now (FloatConstant.read)
            return None
        traced = binding.artifacts.traced
        if traced.guards.check(values) is not None or traced.python_guards.check() is not None:
            return None
        return binding.artifacts, locals_, values

    def _bind(self, model, optimizer, taken: Snapshot, roles, placements, specs, locals_, batch_leaves, constants, hyperparameters, artifacts, tensor_constants, structure) -> None:
        params = dict(model.named_parameters())
        by_label = {c.label: c for c in tensor_constants}
        template: list = []
        gradients, batch_inputs, constant_inputs = [], [], []
        for index, (role, pl, spec, local) in enumerate(zip(roles, placements, specs, locals_)):
            template.append(local if role.kind in ("param", "buffer", "state") else None)
            if role.kind == "grad":
                gradients.append((index, params[role.fqn], pl, torch.Size(spec.shape)))
            elif role.kind == "batch":
                batch_inputs.append((index, int(role.key)))
            elif role.kind == "constant":
                constant_inputs.append((index, by_label[role.key], (local.shape, local.dtype, local.device)))
        self._binding = _Binding(
            snapshot=taken,
            artifacts=artifacts,
            resolved=self._resolved,
            local_template=template,
            gradients=gradients,
            batch_inputs=batch_inputs,
            batch=[(t.shape, t.dtype, t.device, t.requires_grad) for t in batch_leaves],
            constants=constants,
            gradient_sync=self.requires_gradient_sync,
            hyperparameters=hyperparameters,
            tensor_constants=constant_inputs,
            structure=structure,
        )

    def _select(self, model, optimizer, batch_leaves, constants, hyperparameters, values, structure) -> Optional[_Selection]:
        """The inputs and cache entry of a full-path call, and the compiled graph it runs (None: it
        compiles one). None when this rank's batch has a problem (the batch check then raises)."""
        if batch_problems(batch_leaves, self._resolved, self.mesh):
            return None
        taken = snapshot(model, optimizer)
        tensor_constants = step_tensor_constants(self.fn, model, optimizer)
        roles, specs, placements, locals_ = self._inputs(model, optimizer, batch_leaves, tensor_constants)
        # Which places' floats are graph inputs (a graph traced with one as an input takes one more input).
        lifted = tuple(f"{hp}=<float input>" for hp in hyperparameters if isinstance(hp, FloatConstant))
        key = cache_key(
            self._ids, model, optimizer, hyperparameters, tuple(zip(roles, specs, placements)), constants + lifted,
            self.requires_gradient_sync, structure,
        )
        compiled = self.cache.setdefault(key, [])
        artifacts = next(
            (a for a in compiled if a.traced.guards.check(values) is None and a.traced.python_guards.check() is None),
            None,
        )
        return _Selection(taken, roles, specs, placements, locals_, tensor_constants, compiled, artifacts, structure)

    def _run(
        self, args, kwargs, model, optimizer, batch_leaves, constants, hyperparameters, values, selection: _Selection,
        grad_enabled: bool = True, given: Sequence[torch.Tensor] = (),
    ) -> Any:
        """A full-path call: compile the selected state's graph if none holds (:meth:`_select`), bind
        this call for the next ones, run. ``given``: the tensor arguments as passed (``batch_leaves``
        may be contiguous copies of them)."""
        sel = selection
        artifacts = sel.artifacts
        if artifacts is None:
            if sel.compiled:
                last = sel.compiled[-1].traced
                failed = last.guards.check(values)
                arguments = [str(hp) for hp in last.hyperparameters if isinstance(hp, FloatArgument)]
                globals_read = [str(hp) for hp in last.hyperparameters if isinstance(hp, FloatConstant)]
                if failed is not None and any(name in failed for name in globals_read):
                    why = (
                        f"the traced code assumed {failed}. A float the step reads from a global, a closure "
                        f"variable or an attribute and branches on or reads as a number (`torch.tensor(scale)`, `math.exp(scale)`, an "
                        f"op's float setting such as `p=` of dropout or `label_smoothing=`) recompiles on every change; "
                        f"where it changes every call, keep it in a tensor the step reads (a global "
                        f"`SCALE = torch.tensor(1.0)` updated with `.fill_()`: a graph input too) and compute with that"
                    )
                elif failed is not None and any(name in failed for name in arguments):
                    why = (
                        f"the traced code assumed {failed}. A float argument that the step branches on or reads as "
                        f"a number (`torch.tensor(lam)`, `math.exp(lam)`, an op's float setting such as "
                        f"`label_smoothing=lam` or `max_norm=lam`) recompiles on every change; where it changes every "
                        f"call, pass it as a tensor (`torch.tensor(lam)` outside the step) and compute with that"
                    )
                elif failed is not None:
                    why = (
                        f"the traced code assumed {failed}. A hyperparameter that a code path or a kernel takes "
                        f"as a constant recompiles on every change; when a scheduler changes betas or momentum, "
                        f"prefer foreach=True"
                    )
                else:
                    # This runs under no_grad (the graph writes state in place); a guard may read the
                    # caller's grad mode (trace._switch_guards).
                    with torch.set_grad_enabled(grad_enabled):
                        why = last.python_guards.check()
                warnings.warn(
                    f"spmd.compile: compiling {getattr(self.fn, '__name__', 'the step')} again ({len(sel.compiled) + 1} "
                    f"graphs for this step): {why}",
                    stacklevel=4,
                )
            else:
                # A new cache entry. When a Python value the last graph read changed (a float attribute
                # set where there was none, which makes it a graph input: another entry), say so.
                with torch.set_grad_enabled(grad_enabled):  # as above
                    changed = self._binding.artifacts.traced.python_guards.check() if self._binding is not None else None
                if changed is not None:
                    warnings.warn(
                        f"spmd.compile: compiling {getattr(self.fn, '__name__', 'the step')} again: {changed}",
                        stacklevel=4,
                    )
                self._note_new_constants(constants)
                self._note_new_structure(sel.structure)
            self._note_batch_shapes(batch_leaves)
            float_args = [hp for hp in hyperparameters if isinstance(hp, (FloatArgument, FloatConstant))]
            try:
                artifacts = self._compile(
                    args, kwargs, model, optimizer, sel.roles, sel.specs, sel.placements, sel.locals_ + values, float_args,
                    sel.tensor_constants, grad_enabled,
                )
            except (TraceError, UnsupportedOpError, PlacementError, PassError) as e:
                # A stage failed on the graph (not the ranks' agreement or a collective, which tracing
                # again with the values would only repeat).
                if float_args:
                    raise _FloatInputsFailed(e, float_args) from e
                raise
            sel.compiled.append(artifacts)
        _refuse_gradients_without_grad_mode(artifacts, grad_enabled)
        _refuse_writes_to_shared_arguments(artifacts.traced, given, self._labels.get(sel.structure, []), args, kwargs)
        self.last = artifacts
        self._bind(
            model, optimizer, sel.snapshot, sel.roles, sel.placements, sel.specs, sel.locals_, batch_leaves, constants,
            hyperparameters, artifacts, sel.tensor_constants, sel.structure,
        )
        outputs = artifacts.runner(*sel.locals_, *values)
        return self._write_back(artifacts.traced, outputs, model, optimizer, values)

    def _note_new_constants(self, constants: tuple) -> None:
        """Warn when a graph is compiled because a non-tensor argument of the step has a value no
        earlier call had: each value is a constant of its own graph, so an argument that changes on
        every call (a step counter ``i``) compiles on every call."""
        before = self._binding.constants if self._binding is not None else None
        if before is None or before == constants or len(before) != len(constants):
            return
        changed = [f"{new} (before: {old.partition('=')[2]})" for new, old in zip(constants, before) if new != old]
        warnings.warn(
            f"spmd.compile: compiling {getattr(self.fn, '__name__', 'the step')} again for a new value of its "
            f"arguments {', '.join(changed)}. A Python int, bool, string or object argument is a constant of "
            f"the graph (one compilation per value, cached; a float is a graph input): one that changes on "
            f"every call (a step counter) compiles on every call. Pass what the step decides with it "
            f"(`sync=(i + 1) % accumulation == 0`: two values), or a tensor",
            stacklevel=5,
        )

    def _note_new_structure(self, structure: Any) -> None:
        """Warn when a graph is compiled because the arguments' structure changed (a dict batch's keys in
        another order or other keys, keywords in another order): batch tensors are bound to graph inputs
        by their position among the arguments' leaves, so each structure is a graph of its own."""
        before = self._binding.structure if self._binding is not None else None
        if before is None or before == structure:
            return
        old, new = self._labels.get(before, []), self._labels.get(structure, [])
        warnings.warn(
            f"spmd.compile: compiling {getattr(self.fn, '__name__', 'the step')} again for arguments of another "
            f"structure (now {', '.join(new) or '?'}; before {', '.join(old) or '?'}). Batch tensors are graph "
            f"inputs by their position among the arguments, so a dict whose keys come in another order, other "
            f"keys, or keywords in another order compile a graph each (cached). Pass the same keys in the same "
            f"order on every call",
            stacklevel=5,
        )

    def _note_batch_shapes(self, batch_leaves: Sequence[torch.Tensor]) -> None:
        """Warn when a graph is compiled for batch shapes no earlier graph of this step had: each
        distinct shape is traced and compiled once, so batches padded to their longest sequence (a
        collator's dynamic padding) compile once per length, which a user sees as a long stall."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in batch_leaves)
        if shapes in self._batch_shapes:
            return
        self._batch_shapes.append(shapes)
        if len(self._batch_shapes) == 1:
            return
        before = self._batch_shapes[-2]
        changed = [
            f"argument {i}: {new} {str(dtype).replace('torch.', '')}, before {old} {str(old_dtype).replace('torch.', '')}"
            for i, ((new, dtype), (old, old_dtype)) in enumerate(zip(shapes, before))
            if (new, dtype) != (old, old_dtype)
        ] or [f"{len(shapes)} tensor arguments, before {len(before)}"]
        warnings.warn(
            f"spmd.compile: compiling {getattr(self.fn, '__name__', 'the step')} for new batch shapes "
            f"({len(self._batch_shapes)} shapes so far; {'; '.join(changed)}). Every distinct batch shape is "
            f"traced and compiled once (cached); batches padded to their longest sequence compile once per "
            f"length. Pad every batch to one length, or a few (a tokenizer's padding=\"max_length\", "
            f"DataCollatorWithPadding(pad_to_multiple_of=64))",
            stacklevel=5,
        )

    def _write_back(self, traced: TracedStep, outputs: Sequence[torch.Tensor], model, optimizer, values: Sequence[float]) -> Any:
        """Store new optimizer states and gradients as DTensors, assign the Python values the step
        assigns (``values``: the call's hyperparameter values); return the user's values."""
        if (
            len(traced.outputs) == traced.return_is_tensor.count(True) and not traced.cleared_grads
            and not traced.state_writes and not traced.group_writes and not traced.mode_writes
            and not traced.python_writes
        ):
            # Only the user's values (the steady state: states updated in place, gradients cleared
            # by zero_grad before the step ended).
            return pytree.tree_unflatten(_fill(outputs, traced.return_is_tensor), traced.return_spec)
        params = dict(model.named_parameters())
        returns = []
        for role, value, out_node_spec in zip(traced.outputs, outputs, traced.graph_module.graph.output_node().meta["spmd"].inputs):
            if role.kind == "return":
                returns.append(value)
                continue
            dt = DTensor.from_local(value, self.mesh, out_node_spec.placements, run_check=False,
                                    shape=out_node_spec.tensor_meta.shape, stride=out_node_spec.tensor_meta.stride)
            if role.kind == "state":
                optimizer_state.set_state(optimizer, params[role.fqn], role.key, dt)
            else:
                params[role.fqn].grad = dt
        for fqn in traced.cleared_grads:
            params[fqn].grad = None
        for fqn, key, value in traced.state_writes:
            optimizer_state.set_state(optimizer, params[fqn], key, value)
        for index, key, value in traced.group_writes:
            optimizer.param_groups[index][key] = value
        for fqn, training in traced.mode_writes:
            model.get_submodule(fqn).training = training
        for assign in traced.python_writes:
            assign(values)
        return pytree.tree_unflatten(_fill(returns, traced.return_is_tensor), traced.return_spec)


def _refuse_gradients_without_grad_mode(artifacts: StepArtifacts, grad_enabled: bool) -> None:
    """A step that computes gradients, called with gradient computation off (under ``torch.no_grad()``
    or ``torch.inference_mode()``): one device's ``loss.backward()`` raises there (the loss has no
    ``grad_fn``); the graph, traced with gradients on, would train. Refused before it runs.

    Raises:
        TraceError: naming the backward call's line and the fix.
    """
    node = artifacts.traced.first_backward_node if not grad_enabled else None
    if node is not None:
        raise TraceError(
            f"the step computes gradients (at {user_source_line(node)}) but is called with gradient computation "
            f"off (under torch.no_grad() or torch.inference_mode()), where one device's backward raises (the "
            f"loss has no grad_fn) and nothing would train\n"
            f"  fix: call the training step outside torch.no_grad(); an evaluation step leaves out backward "
            f"and the optimizer"
        )


def _refuse_writes_to_shared_arguments(traced: Any, given: Sequence[torch.Tensor], labels: Sequence[str], args: tuple, kwargs: dict) -> None:
    """Raise BatchError where the step writes in place a tensor argument whose memory another one
    shares (:func:`~spmd_expand.guards.overlapping_batch_leaves`): the graph takes each as an input of
    its own, so the other would not see the write (one device's would). Read-only steps may share
    (``step(model, opt, x, x)`` of an autoencoder; a language model's ``data[:, :-1], data[:, 1:]``).
    Only graphs that write a batch tensor look (rare), before anything runs; every rank passes its
    tensors from the same code, so all raise alike."""
    written = traced.mutated_batch_leaves
    pairs = [(i, j) for i, j in overlapping_batch_leaves(given) if i in written or j in written] if written else []
    if not pairs:
        return
    leaves = pytree.tree_leaves((args, kwargs))
    tensor_labels = [label for label, x in zip(labels, leaves) if isinstance(x, torch.Tensor)]

    def name(i: int) -> str:
        return f"{i} ({tensor_labels[i]})" if i < len(tensor_labels) else str(i)

    i, j = pairs[0]
    writer = i if i in written else j
    raise BatchError(
        f"tensor arguments {name(i)} and {name(j)} of the step share memory (one tensor passed twice, or "
        f"overlapping views of one), and the step writes argument {name(writer)} in place: the compiled graph "
        f"takes each argument as an input of its own, so the other would not see the write. Nothing ran. Pass "
        f"a copy (`x, x.clone()`), or write out of place inside the step (`x = x * 2` for `x.mul_(2)`)"
    )


def _run_checked(runner: Callable[..., list], inputs: list, start: Callable[[Optional[int]], Optional[PendingCheck]]) -> list:
    """Run the lowered step with the call's rank check (``start(count)``: :func:`~spmd_expand.guards.start_check`)
    in flight: its verdict comes after the graph's prologue (:class:`~spmd_expand.prologue.PrologueRunner`),
    before the rest; for a graph without one, before the graph."""
    if not isinstance(runner, PrologueRunner):
        pending = start(None)
        if pending is not None:
            pending.finish()
        return runner(*inputs)
    started: list = []

    def check(count: Optional[int]) -> Optional[Callable[[], Optional[int]]]:
        started.append(start(count))
        return started[0].finish if started[0] is not None else None

    try:
        return runner.run(inputs, check)
    except BaseException:
        if started and started[0] is not None and not started[0].done:
            started[0].finish()  # this rank failed before its verdict: the peers still get it
        raise


def _in_traced_layout(batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The batch tensors as the step was traced: contiguous (:class:`TensorSpec` has no strides).

    A view such as the inputs and targets of a language model, ``data[:, :-1]`` and ``data[:, 1:]``,
    is copied into a contiguous tensor; a ``view`` the graph took of the contiguous traced tensor
    would fail on it (or an Inductor kernel would read it with the wrong strides). Contiguous tensors
    are passed as they are, and so are tensors of other layouts (sparse, nested: refused by the batch
    check)."""
    return [t if not is_dense(t) or t.is_contiguous() else t.contiguous() for t in batch]


def _fill(returns: Sequence[torch.Tensor], is_tensor: Sequence[bool]) -> list:
    values = iter(returns)
    return [next(values) if t else None for t in is_tensor]


def compile(
    *,
    mesh: DeviceMesh,
    plan: Plan,
    lower: str = "inductor",
    passes: Union[str, Sequence[Any], None] = "default",
    module_override: Optional[Sequence[Override]] = None,
    keep_graphs: bool = False,
    timeout: Union[None, float, timedelta] = None,
) -> Callable[[Callable[..., Any]], CompiledStep]:
    """Compile a single-device train step into an SPMD program over ``mesh``.

    The step is ``fn(model, optimizer, *batch)`` (any argument order; exactly one ``nn.Module`` and at
    most one ``torch.optim.Optimizer``) that runs forward, ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()`` and returns tensors. Each rank calls it with its local batch; the result
    equals the single-device step over the global batch (the ranks' batches concatenated along the
    plan's batch dim), returned as plain full tensors.

    The first call traces and compiles; a later call whose state the graph did not see (another model
    or optimizer, ``train()``/``eval()``, ``requires_grad``, shapes, param-group structure; see
    :mod:`spmd_expand.guards`) compiles again. Float hyperparameters (``lr``, ``betas``, ...) and the
    step's float arguments are graph inputs: LR schedulers and a ``lam`` that changes every call need no
    recompilation. After the first call the model's parameters and the
    optimizer's states are DTensors with the plan's placements (the model's parameters are new
    ``nn.Parameter`` objects: re-read them from the model rather than keeping old references).

    Args:
        mesh: the ``DeviceMesh`` the plan refers to.
        plan: ``spmd.DDP(...)`` for a 1-D mesh, or ``{mesh_dim_name: style}``.
        lower: ``"inductor"`` (default) or ``"eager"`` (run the expanded fx graph as is).
        passes: ``"default"`` (``sync_batch_norm``, ``regather_for_backward``, ``horizontal_fusion``,
            ``bucketing``, ``overlap``; see :mod:`spmd_expand.passes`), or a list of pass names, ``SpmdPass`` objects
            and callables on the local graph; ``[]`` runs none. ``spmd_expand.passes.default_passes(disable=[...])``
            drops some by name.
        module_override: :class:`Override` objects that swap untraceable submodules while tracing.
        keep_graphs: keep a copy of the graph after every pass in ``step.last.passes`` (for
            ``spmd-expand dump`` and debugging; costs a graph copy per pass).
        timeout: seconds (or a ``timedelta``) after which a collective on the mesh's process groups
            fails instead of waiting on: set on the groups now (``ProcessGroup.set_timeout``; it applies
            to every later collective on them). Default None keeps the groups' timeout
            (``init_process_group(timeout=...)``; 30 minutes for gloo). A collective of the step that
            fails or times out raises ``CollectiveError`` naming its node (:mod:`spmd_expand.watch`).
            It also bounds the cross-rank checks' wait for the other ranks (``DivergenceError``).

    Raises:
        TraceError, PlanError, UnsupportedOpError, PlacementError, BatchError (uneven or empty local
        batches, on every rank at once), PassError (a pass failed, or ``passes`` names an unknown
        pass), DivergenceError (ranks traced different programs), CollectiveError (a collective failed
        or timed out while the step ran): all subclasses of ``SpmdError``; ``SpmdError`` for a
        ``timeout`` that is not a positive number of seconds.
    """

    def wrap(fn: Callable[..., Any]) -> CompiledStep:
        return CompiledStep(
            fn, mesh, plan, lower=lower, passes=passes, module_override=module_override, keep_graphs=keep_graphs,
            timeout=timeout,
        )

    return wrap
