"""``spmd.compile``: the user-facing entry point, and the training state it keeps as DTensors.

:class:`CompiledStep` finds the model and optimizer among the step's arguments, keeps their state as
DTensors, checks on every call what the compiled graph assumed (:mod:`spmd_expand.guards`), runs the
compiled graph and writes its results back. Compiling is :func:`spmd_expand.pipeline.compile_step`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.weak import WeakIdKeyDictionary

from .errors import PlanError, SpmdError, TraceError
from .expand import RedistributeCache
from .guards import ObjectIds, Snapshot, cache_key, check_batch, initialize_optimizer_state, mesh_group, snapshot
from .lower import LOWERINGS
from .passes import resolve_passes
from .pipeline import Override, StepArtifacts, compile_step
from .plans import Plan, ResolvedPlan, resolve_plan
from .rank_check import check_ranks_agree, state_entries
from .spec import AS_PRODUCED, local_slice, replicate
from .trace import HyperParameter, InputRole, TensorSpec, TracedStep, hyperparameters_of
from .watch import as_timedelta, set_group_timeouts

__all__ = ["compile", "CompiledStep", "Override", "StepArtifacts", "distribute_state"]


def _find(leaves: Sequence[Any], kind: type, what: str, at_most_one: bool) -> Optional[Any]:
    found = list({id(x): x for x in leaves if isinstance(x, kind)}.values())
    if len(found) > 1 or (not at_most_one and not found):
        if at_most_one:  # optimizers
            fix = (
                "one optimizer over all parameters when they step together; when they step at different "
                "points (a GAN's discriminator and generator updates), one compiled step per optimizer, each "
                "taking the model that holds every module and its own optimizer: d_step(gan, opt_d, real, z) "
                "and g_step(gan, opt_g, z), with gan = nn.ModuleDict(G=G, D=D) (the steps share the model)"
            )
        else:
            fix = "wrap several modules in one nn.Module (nn.ModuleDict(G=G, D=D)) and pass that"
        raise TraceError(
            f"spmd.compile needs exactly one nn.Module and at most one torch.optim.Optimizer among the step's "
            f"arguments; found {len(found)} {what}\n  fix: {fix}"
        )
    return found[0] if found else None


# Each parameter distribute_state replaced, and the DTensor parameter that replaced it (weak keys: an
# entry lives as long as something, such as an optimizer built before the conversion, holds the old one).
REPLACED_PARAMETERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds (``model = torch.compile(model)``), else ``model``:
    the plan's FQNs name its submodules, not ``_orig_mod.*``. The step still calls the wrapper, which
    runs the module's own forward while the step is traced (:func:`spmd_expand.trace.trace_step`)."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def _rebind_parameters(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], new: dict[int, nn.Parameter]) -> None:
    """Replace parameters everywhere they are referenced: owning modules (tied ones too), the flat
    weight lists of RNN modules, and optimizer."""
    for module in model.modules():
        replaced = False
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                module._parameters[name] = new[id(p)]
                REPLACED_PARAMETERS[p] = new[id(p)]
                replaced = True
        if replaced and isinstance(module, nn.RNNBase):
            # nn.LSTM / GRU / RNN read their weights from _flat_weights, which nn.Module.__setattr__
            # refreshes; a write into _parameters does not.
            module._init_flat_weights()
    if optimizer is not None:
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in new:
                    old = p
                    group["params"][i] = new[id(p)]
                    if old in optimizer.state:
                        optimizer.state[new[id(old)]] = optimizer.state.pop(old)


# Each DTensor parameter's wrapper storage and local tensor, as distribute_state last saw them, kept
# on the parameter (a weak reference to it would stop ``torch.utils.swap_tensors``).
# ``param.data = value`` on a DTensor swaps the wrapper's storage but not ``_local_tensor``, the only
# values DTensor (and the compiled step) reads: the assignment is lost, with no error from torch.
# ``swap_tensors`` (``model.to(...)``, ``to_empty``) swaps both, and this attribute with them.
_SEEN_STORAGE = "_spmd_seen_storage"


def _refuse_lost_data_assignments(model: nn.Module) -> None:
    """Raise PlanError for a DTensor parameter assigned through ``.data =`` since it was last seen;
    remember every DTensor parameter's wrapper storage and local tensor for the next check."""
    for fqn, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        now = (p.untyped_storage()._cdata, id(p._local_tensor))
        before = getattr(p, _SEEN_STORAGE, None)
        if before is not None and before[0] != now[0] and before[1] == now[1]:
            raise PlanError(
                f"parameter {fqn!r} was assigned with `.data = ...` after spmd.compile made it a DTensor "
                f"({', '.join(map(repr, p.placements))} over mesh dims {p.device_mesh.mesh_dim_names or tuple(range(p.device_mesh.ndim))}): "
                f"a DTensor keeps this rank's values in its local tensor, which a `.data` assignment does not "
                f"change, so the assignment was lost (torch's DTensor raises no error). The parameter still holds "
                f"its old values; nothing was run.\n"
                f"  fix: write the new values in place: `with torch.no_grad(): p.copy_(value)` with `value` a "
                f"DTensor, or `p.copy_(distribute_tensor(value, p.device_mesh, p.placements))` with a full "
                f"tensor; or load a whole state dict with torch.distributed.checkpoint.state_dict.set_model_state_dict"
            )
        setattr(p, _SEEN_STORAGE, now)


class _Stale(Exception):
    """An input of the bound call is not what the graph was compiled for: take the full path."""


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
    batch: list[tuple]  # (shape, dtype, device) of every batch tensor
    constants: tuple
    gradient_sync: bool
    hyperparameters: list[HyperParameter]

    def local_inputs(self, batch_leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = list(self.local_template)
        for index, leaf in self.batch_inputs:
            out[index] = batch_leaves[leaf]
        for index, param, placements, shape in self.gradients:
            grad = param.grad
            if type(grad) is not DTensor or grad.placements != placements or grad.shape != shape:
                raise _Stale
            out[index] = grad._local_tensor
        return out


def distribute_state(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    mesh: DeviceMesh,
    plan: ResolvedPlan,
    timeout: Optional[timedelta] = None,
) -> None:
    """Turn parameters (and existing optimizer states) into DTensors with the plan's placements.

    Replicated parameters are broadcast from rank 0 (``distribute_tensor``), as DDP does at
    construction; sharded ones become this rank's piece of rank 0's tensor (:func:`_distribute`). Parameters
    that already are DTensors are kept. Buffers stay plain tensors and are broadcast from rank 0.
    The conversion of ``spmd.compile``'s first call and of :func:`spmd_expand.parallelize`.
    ``timeout`` bounds the wait of the cross-rank check (default: the store's).

    Parameters on the meta device (a model built under ``torch.device("meta")``) become meta
    DTensors with the plan's placements and this rank's local shape (``Shard(0)``: dim 0 split as
    ``torch.chunk`` splits it), with no communication; meta buffers stay meta. Nothing is allocated:
    ``model.to_empty(device=...)`` then allocates only the local shards, to be initialized or loaded
    into (FSDP2's flow); the broadcast of replicated state happens before the first step instead
    (:func:`broadcast_materialized_state`). The cross-rank check compares names, shapes, dtypes,
    placements and which tensors are meta, never values.

    Raises:
        DivergenceError: before the first broadcast, when the ranks' models differ (names, shapes,
            dtypes, ``requires_grad``, placements; :mod:`spmd_expand.rank_check`).
        PlanError: a parameter or buffer of a lazy module (``nn.LazyLinear``, ...) has no shape yet; a
            DTensor parameter was assigned through ``.data =`` since the last call (the values were lost).
    """
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for fqn, t in named:
            if nn.parameter.is_lazy(t):
                raise PlanError(
                    f"{kind} {fqn!r} of {type(model).__name__} is uninitialized (a lazy module, e.g. nn.LazyLinear, "
                    f"creates it on its first call), so it has no shape to place: run the model once on one batch "
                    f"before the first step (as torch's DDP and FSDP require), e.g. `with torch.no_grad(): model(x)`"
                )
    if any(not isinstance(p, DTensor) for p in model.parameters()):
        check_ranks_agree(
            f"the parameters and buffers of {type(model).__name__}",
            *state_entries(model, plan.param_placements),
            mesh,
            timeout,
        )
    new: dict[int, nn.Parameter] = {}
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        _DISTRIBUTED_ON_META.add(model)
    for fqn, p in model.named_parameters():
        if isinstance(p, DTensor):
            continue
        dt = _distribute(p.detach(), mesh, plan.param_placements(fqn, p))
        new[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
        # The user's gradient hooks go with the parameter (the same dicts: their handles still remove them).
        if p._backward_hooks:
            new[id(p)]._backward_hooks = p._backward_hooks
        if getattr(p, "_post_accumulate_grad_hooks", None):
            new[id(p)]._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    if optimizer is not None:
        for p, st in optimizer.state.items():
            for key, v in list(st.items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                    st[key] = _distribute(v, mesh, plan.state_placements(fqn_of[id(p)], p, v))
    if new:
        # Buffers stay plain tensors, replicated: every rank must hold rank 0's values (a rank that
        # differs would silently compute another model), so they are broadcast along with the
        # parameters, as DDP does at construction.
        for b in model.buffers():
            if not isinstance(b, DTensor) and not b.is_meta:
                b.copy_(distribute_tensor(b, mesh, replicate(mesh)).to_local())
    _make_buffers_contiguous(model)
    _rebind_parameters(model, optimizer, new)
    _refuse_lost_data_assignments(model)
    if new and model not in _ACCEPTS_FULL_STATE_DICTS:
        model.register_load_state_dict_pre_hook(_distribute_loaded_tensors)
        _ACCEPTS_FULL_STATE_DICTS.add(model)


# Models whose load_state_dict turns plain full tensors into DTensors (:func:`_distribute_loaded_tensors`).
_ACCEPTS_FULL_STATE_DICTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _distribute_loaded_tensors(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of a model whose parameters are DTensors: a plain tensor of a
    parameter's full (global) shape, as ``torch.save(model.state_dict())`` of a single-device model
    or ``{k: v.full_tensor()}`` wrote it, is distributed with the parameter's placements first, from
    the mesh's first rank, as :func:`distribute_state` does on the first call; ``param.copy_`` of a
    plain tensor into a DTensor would raise. Other entries (DTensors, buffers, wrong shapes: torch's
    size-mismatch error) are left to ``load_state_dict``. ``state_dict`` is torch's copy of the
    caller's dict; the caller's tensors are not written (the broadcast goes to a copy)."""
    for fqn, param in module.named_parameters():
        value = state_dict.get(prefix + fqn)
        if isinstance(param, DTensor) and type(value) is torch.Tensor and value.shape == param.shape:
            source = value.detach().to(device=param.to_local().device, copy=True)
            state_dict[prefix + fqn] = _distribute(source, param.device_mesh, param.placements)


# Models spmd.compile converted, whose forward refuses plain tensors outside a step (:func:`_refuse_eager_call`).
_EAGER_CALLS_REFUSED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _refuse_eager_calls(model: nn.Module) -> None:
    """Register :func:`_refuse_eager_call` on ``model`` and on each submodule that holds parameters
    itself (a GAN's generator in a ``ModuleDict``, ``model.lm_head``), once per model."""
    if model in _EAGER_CALLS_REFUSED:
        return
    for fqn, module in model.named_modules():
        if module is model or module._parameters:
            module.register_forward_pre_hook(functools.partial(_refuse_eager_call, fqn, model), with_kwargs=True)
    _EAGER_CALLS_REFUSED.add(model)


def _refuse_eager_call(fqn: str, root: nn.Module, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a model ``spmd.compile`` converted (``root``) and of its submodule ``fqn``:
    calling it eagerly on real plain tensors (an evaluation or sampling loop outside the compiled step,
    e.g. nanoGPT's ``estimate_loss``) would meet DTensor parameters and stop in DTensor's "mixed
    torch.Tensor and DTensor" error; this names the fix instead. Calls the step's trace makes (fake
    tensors) and Dynamo's are let through."""
    if torch.compiler.is_compiling():
        return
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors or not all(type(t) is torch.Tensor for t in tensors):
        return
    param = next((p for p in module.parameters() if isinstance(p, DTensor)), None)
    if param is None:
        return
    called = type(module).__name__ if module is root else f"{type(module).__name__} {fqn} (a submodule of {type(root).__name__})"
    raise PlanError(
        f"{called} was called outside a compiled step on plain tensors, but spmd.compile made its "
        f"parameters DTensors on its first call (e.g. placements {tuple(param.placements)} on {param.device_mesh})\n"
        f"  fix: run the evaluation as a compiled step with the same mesh and plan, on this rank's part of the "
        f"batch: `evaluate = spmd.compile(mesh=mesh, plan=plan)(lambda model, x, y: loss_fn(model(x), y))` "
        f"(it returns global values; README, 'Evaluation steps'); for a single-device copy of the model "
        f"(sampling, export), load `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` "
        f"(torch.distributed.checkpoint.state_dict) into a fresh model"
    )


def _make_buffers_contiguous(model: nn.Module) -> None:
    """Replace each buffer that is not contiguous (``torch.randn(4, 16).t()``) by a contiguous copy
    with the same values, as graph inputs are traced contiguous (:func:`_in_traced_layout` for batches;
    a buffer may be written by the step in place, so the copy takes its place in the module)."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_contiguous():
                module._buffers[name] = b.contiguous()


def _distribute(tensor: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """``distribute_tensor`` from the mesh's first rank; a meta tensor has no values to send, so each
    rank only cuts its local shape (no collective).

    Sharded (``Shard``/``Replicate`` only) placements: the full tensor is broadcast in place from the
    mesh's first rank (as DDP's construction broadcasts), then each rank cuts its own piece
    (:func:`~spmd_expand.spec.local_slice`: DTensor's chunking) and copies it. ``distribute_tensor``
    splits and pads all W pieces on every rank, O(W) Python work per parameter (6.7 s of an FSDP dump
    at W=16,384); this is O(1) in W. The same values either way: the first rank's tensor, chunked as
    DTensor chunks it.
    """
    if not all(type(p) in (Shard, Replicate) for p in placements) or not any(type(p) is Shard for p in placements):
        return distribute_tensor(tensor, mesh, placements, src_data_rank=None if tensor.is_meta else 0)
    source = tensor
    if not tensor.is_meta and mesh.size() > 1:
        source = tensor.contiguous()  # NCCL sends contiguous tensors only; in place when it already is
        dist.broadcast(source, src=int(mesh.mesh.flatten()[0]), group=mesh_group(mesh))
    local = local_slice(source, mesh, placements)
    return DTensor.from_local(
        local.clone(memory_format=torch.contiguous_format), mesh, placements, run_check=False,
        shape=tensor.shape, stride=tensor.stride(),
    )


# Models distributed while on the meta device: their replicated state gets values only later
# (to_empty, then the user's init or load), so it is broadcast once it has them.
_DISTRIBUTED_ON_META: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def broadcast_materialized_state(model: nn.Module, mesh: DeviceMesh, where: str) -> None:
    """Before the first step of a model distributed on the meta device: refuse state still on meta,
    then broadcast every replicated parameter and buffer (each ``Replicate()`` mesh dim, from that
    dim's first rank), once.

    This is the broadcast :func:`distribute_state` does for a materialized model (DDP's broadcast at
    construction), moved to after initialization: DTensor random init on a CPU mesh draws each rank's
    local tensor from its own generator, so replicated parameters may differ across ranks (e.g. after
    unevenly sharded parameters drew different counts). Sharded parameters are left as they are.

    Raises:
        TraceError: a parameter or buffer is still on the meta device (names it and the fix:
            ``to_empty``, then initialize or load).
    """
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for fqn, t in named:
            if t.is_meta:
                raise TraceError(
                    f"{where}: {kind} {fqn!r} of {type(model).__name__} is on the meta device (no values); call "
                    f"model.to_empty(device=...) after spmd.parallelize / CompiledStep.prepare, then initialize it "
                    f"(model.apply(init_fn), reset_parameters()) or load a checkpoint into it, before the first step"
                )
    if model not in _DISTRIBUTED_ON_META or not dist.is_initialized() or dist.get_backend() == "fake":
        return
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            local, placements = (t.to_local(), t.placements) if isinstance(t, DTensor) else (t, replicate(mesh))
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, Replicate) and mesh.size(mesh_dim) > 1:
                    dist.broadcast(local, group=mesh.get_group(mesh_dim), group_src=0)
    _DISTRIBUTED_ON_META.discard(model)


def _adopt_replaced_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Point ``optimizer`` at the DTensor parameters that replaced the plain ones it was built over,
    when the model was converted by a call the optimizer was not handed to (an evaluation step run
    before the first training step, or :meth:`CompiledStep.prepare` without it). Its state moves along."""
    owned = {id(p) for p in model.parameters()}
    moved = {
        id(p): REPLACED_PARAMETERS[p]
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) not in owned and p in REPLACED_PARAMETERS and id(REPLACED_PARAMETERS[p]) in owned
    }
    if moved:
        _rebind_parameters(model, optimizer, moved)


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise PlanError for an optimizer parameter the model does not own (the step could not
    place, reduce or write back its gradient)."""
    owned = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in owned:
                raise PlanError(
                    f"the optimizer's param_groups[{g}]['params'][{i}] (shape {list(p.shape)}, {p.dtype}) is not a "
                    f"parameter of the {type(model).__name__} passed to the step\n"
                    f"  fix: build the optimizer over model.parameters() of the model the step receives (after any "
                    f"module swap or parallelize call), or give the step the module that owns this parameter"
                )


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
        functools.update_wrapper(self, fn)

    def reset(self) -> None:
        """Drop every compiled graph of this step: the next call traces and compiles again (the
        counterpart of ``torch.compiler.reset()`` for one compiled step; e.g. to time a compile).
        The model's and optimizer's distributed state is kept."""
        self.cache.clear()
        self.redistribute_cache = RedistributeCache()
        self._binding = None
        self._batch_shapes.clear()

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
    def _inputs(self, model, optimizer, batch_leaves):
        """(roles, global specs, placements, local tensors) of every graph input, in graph order."""
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
            for fqn, p in params.items():
                for key, v in optimizer.state.get(p, {}).items():
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
        return roles, specs, placements, locals_

    # ------------------------------------------------------------------ compile
    def _compile(self, args, kwargs, model, optimizer, roles, specs, placements, example_inputs) -> StepArtifacts:
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
        model = _unwrapped(model)
        if optimizer is not None:
            _adopt_replaced_parameters(model, optimizer)
            _check_optimizer_params(model, optimizer)
        if model not in self._plans:
            self._plans[model] = resolve_plan(self.plan, self.mesh, model)
        self._resolved = self._plans[model]
        self._distribute_state(model, optimizer)
        _refuse_eager_calls(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            # An evaluation under torch.inference_mode(): the model's DTensor parameters, the optimizer
            # state and the compiled graph's caches made here must stay ordinary tensors (an inference
            # tensor can never be used by autograd or updated in place again), so the step runs outside
            # it; the batch, inference tensors or not, is only read.
            with torch.inference_mode(False):
                return self(*args, **kwargs)
        leaves, _ = pytree.tree_flatten((args, kwargs))
        model = _unwrapped(_find(leaves, nn.Module, "modules", at_most_one=False))
        optimizer = _find(leaves, torch.optim.Optimizer, "optimizers", at_most_one=True)
        given = [x for x in leaves if isinstance(x, torch.Tensor)]
        batch_leaves = _in_traced_layout(given)
        constants = tuple(repr(x) for x in leaves if not isinstance(x, (torch.Tensor, nn.Module, torch.optim.Optimizer)))
        bound = self._bound_call(model, optimizer, batch_leaves, constants)
        if bound is None:
            # Every full call: state loaded since the last call (e.g. by set_state_dict) may be plain tensors.
            self.prepare(model, optimizer)
            broadcast_materialized_state(model, self.mesh, "spmd.compile")
            if optimizer is not None:
                attempted = self._state_attempted.setdefault(optimizer, set())
                if initialize_optimizer_state(model, optimizer, attempted):
                    self._distribute_state(model, optimizer)
        else:
            self._resolved = self._binding.resolved
        check_batch(batch_leaves, self._resolved, self.mesh, constants)
        # The step updates local shards in place; autograd must not track that.
        with torch.no_grad():
            if bound is not None:
                artifacts, locals_, values = bound
                self.last = artifacts
                result = self._write_back(artifacts.traced, artifacts.runner(*locals_, *values), model, optimizer)
            else:
                result = self._run(args, kwargs, model, optimizer, leaves, batch_leaves, constants)
            for i in self.last.traced.mutated_batch_leaves:
                if batch_leaves[i] is not given[i]:
                    given[i].copy_(batch_leaves[i])  # the step wrote the contiguous copy in place
        return result

    def _bound_call(self, model, optimizer, batch_leaves, constants) -> Optional[tuple]:
        """(artifacts, local inputs, hyperparameter values) when this call matches the last full one
        (:class:`_Binding`) and its graph's guards hold; else None (take the full path)."""
        binding = self._binding
        if (
            binding is None
            or binding.gradient_sync != self.requires_gradient_sync
            or binding.constants != constants
            or len(binding.batch) != len(batch_leaves)
            or any((t.shape, t.dtype, t.device) != b for t, b in zip(batch_leaves, binding.batch))
            or not snapshot(model, optimizer).same_as(binding.snapshot)
        ):
            return None
        try:
            locals_ = binding.local_inputs(batch_leaves)
        except _Stale:
            return None
        values = [hp.read(optimizer) for hp in binding.hyperparameters]
        traced = binding.artifacts.traced
        if traced.guards.check(values) is not None or traced.python_guards.check() is not None:
            return None
        return binding.artifacts, locals_, values

    def _bind(self, model, optimizer, taken: Snapshot, roles, placements, specs, locals_, batch_leaves, constants, hyperparameters, artifacts) -> None:
        params = dict(model.named_parameters())
        template: list = []
        gradients, batch_inputs = [], []
        for index, (role, pl, spec, local) in enumerate(zip(roles, placements, specs, locals_)):
            template.append(local if role.kind in ("param", "buffer", "state") else None)
            if role.kind == "grad":
                gradients.append((index, params[role.fqn], pl, torch.Size(spec.shape)))
            elif role.kind == "batch":
                batch_inputs.append((index, int(role.key)))
        self._binding = _Binding(
            snapshot=taken,
            artifacts=artifacts,
            resolved=self._resolved,
            local_template=template,
            gradients=gradients,
            batch_inputs=batch_inputs,
            batch=[(t.shape, t.dtype, t.device) for t in batch_leaves],
            constants=constants,
            gradient_sync=self.requires_gradient_sync,
            hyperparameters=hyperparameters,
        )

    def _run(self, args, kwargs, model, optimizer, leaves, batch_leaves, constants) -> Any:
        taken = snapshot(model, optimizer)
        roles, specs, placements, locals_ = self._inputs(model, optimizer, batch_leaves)
        hyperparameters = hyperparameters_of(optimizer)
        values = [hp.read(optimizer) for hp in hyperparameters]
        key = cache_key(
            self._ids, model, optimizer, hyperparameters, tuple(zip(roles, specs, placements)), constants,
            self.requires_gradient_sync,
        )
        compiled = self.cache.setdefault(key, [])
        artifacts = next(
            (a for a in compiled if a.traced.guards.check(values) is None and a.traced.python_guards.check() is None),
            None,
        )
        if artifacts is None:
            if compiled:
                last = compiled[-1].traced
                failed = last.guards.check(values)
                if failed is not None:
                    why = (
                        f"the traced code assumed {failed}. A hyperparameter that a code path or a kernel takes "
                        f"as a constant recompiles on every change; when a scheduler changes betas or momentum, "
                        f"prefer foreach=True"
                    )
                else:
                    why = last.python_guards.check()
                warnings.warn(
                    f"spmd.compile: compiling {getattr(self.fn, '__name__', 'the step')} again ({len(compiled) + 1} "
                    f"graphs for this step): {why}",
                    stacklevel=3,
                )
            self._note_batch_shapes(batch_leaves)
            artifacts = self._compile(args, kwargs, model, optimizer, roles, specs, placements, locals_ + values)
            compiled.append(artifacts)
        self.last = artifacts
        self._bind(model, optimizer, taken, roles, placements, specs, locals_, batch_leaves, constants, hyperparameters, artifacts)
        outputs = artifacts.runner(*locals_, *values)
        return self._write_back(artifacts.traced, outputs, model, optimizer)

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
            stacklevel=4,
        )

    def _write_back(self, traced: TracedStep, outputs: Sequence[torch.Tensor], model, optimizer) -> Any:
        """Store new optimizer states and gradients as DTensors; return the user's values."""
        if (
            len(traced.outputs) == traced.return_is_tensor.count(True) and not traced.cleared_grads
            and not traced.state_writes and not traced.group_writes and not traced.mode_writes
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
                optimizer.state[params[role.fqn]][role.key] = dt
            else:
                params[role.fqn].grad = dt
        for fqn in traced.cleared_grads:
            params[fqn].grad = None
        for fqn, key, value in traced.state_writes:
            optimizer.state[params[fqn]][key] = value
        for index, key, value in traced.group_writes:
            optimizer.param_groups[index][key] = value
        if traced.mode_writes:
            modules = dict(model.named_modules())
            for fqn, training in traced.mode_writes:
                modules[fqn].training = training
        return pytree.tree_unflatten(_fill(returns, traced.return_is_tensor), traced.return_spec)


def _in_traced_layout(batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The batch tensors as the step was traced: contiguous (:class:`TensorSpec` has no strides).

    A view such as the inputs and targets of a language model, ``data[:, :-1]`` and ``data[:, 1:]``,
    is copied into a contiguous tensor; a ``view`` the graph took of the contiguous traced tensor
    would fail on it (or an Inductor kernel would read it with the wrong strides). Contiguous tensors
    are passed as they are."""
    return [t if t.is_contiguous() else t.contiguous() for t in batch]


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
    :mod:`spmd_expand.guards`) compiles again. Float hyperparameters (``lr``, ``betas``, ...) are graph
    inputs: LR schedulers need no recompilation. After the first call the model's parameters and the
    optimizer's states are DTensors with the plan's placements (the model's parameters are new
    ``nn.Parameter`` objects: re-read them from the model rather than keeping old references).

    Args:
        mesh: the ``DeviceMesh`` the plan refers to.
        plan: ``spmd.DDP(...)`` for a 1-D mesh, or ``{mesh_dim_name: style}``.
        lower: ``"inductor"`` (default) or ``"eager"`` (run the expanded fx graph as is).
        passes: ``"default"`` (``regather_for_backward``, ``horizontal_fusion``, ``bucketing``,
            ``overlap``; see :mod:`spmd_expand.passes`), or a list of pass names, ``SpmdPass`` objects
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
