"""The training state of a compiled step as DTensors: the conversion of a model's parameters and
buffers and an optimizer's states (:func:`distribute_state`), and what keeps that state consistent
afterwards.

* ``model.load_state_dict`` of plain full tensors distributes them (:func:`_distribute_loaded_tensors`);
* ``param.data = ...`` on a DTensor parameter, which DTensor would silently lose, is refused
  (:func:`_refuse_lost_data_assignments`);
* a converted model called eagerly on plain tensors raises :class:`~spmd_expand.errors.PlanError`
  naming the fix (:func:`refuse_eager_calls`);
* an optimizer built before the conversion is pointed at the new parameters
  (:func:`adopt_replaced_parameters`; ``REPLACED_PARAMETERS``).

Used by :class:`spmd_expand.api.CompiledStep` (on its first call) and :func:`spmd_expand.backend.parallelize`.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import optimizer_state
from .errors import PlanError, TraceError
from .guards import check_state_distribution, mesh_group, not_dense_problem
from .plans import ResolvedPlan
from .rank_check import check_ranks_agree, state_entries
from .spec import local_slice, replicate

__all__ = [
    "REPLACED_PARAMETERS",
    "adopt_replaced_parameters",
    "broadcast_materialized_state",
    "check_optimizer_params",
    "distribute_state",
    "refuse_eager_calls",
    "unwrapped",
]


# Each parameter distribute_state replaced, and the DTensor parameter that replaced it (weak keys: an
# entry lives as long as something, such as an optimizer built before the conversion, holds the old one).
REPLACED_PARAMETERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds (``model = torch.compile(model)``), else ``model``:
    the plan's FQNs name its submodules, not ``_orig_mod.*``. The step still calls the wrapper, which
    runs the module's own forward while the step is traced (:func:`spmd_expand.trace.trace_step`)."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


_OPTIMIZER_CHECK: list = []  # the handle of the global optimizer step pre-hook, once installed


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global ``optimizer.step()`` pre-hook (installed with the first parameter replaced): refuse an
    optimizer over parameters that were replaced by DTensor parameters and not rebound in it: one
    built before :func:`~spmd_expand.backend.parallelize`, or one that ``spmd.compile``'s step reaches
    without being its optimizer argument (a GAN's second optimizer in a global or inside another
    object). Those tensors get no gradients any more, so its step would skip every one of them and
    train nothing, without an error (inside a traced step too). Costs one emptiness test per step
    unless a replaced parameter is still alive somewhere."""
    if not REPLACED_PARAMETERS:
        return
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p in REPLACED_PARAMETERS:
                raise PlanError(
                    f"{type(optimizer).__name__}.step(): param_groups[{g}]['params'][{i}] (shape {list(p.shape)}) "
                    f"is a parameter that spmd_expand replaced by a DTensor parameter, and this optimizer still "
                    f"holds the old tensor, which gets no gradients any more: its step would update nothing\n"
                    f"  fix: with spmd.compile, pass the optimizer to the step as its argument (spmd.compile "
                    f"rebinds that one; a step takes one optimizer, so compile one step per optimizer, e.g. a "
                    f"discriminator step and a generator step); with spmd.parallelize, build the optimizer "
                    f"after model = spmd.parallelize(model, mesh, plan), over model.parameters()"
                )


def _install_optimizer_check() -> None:
    if not _OPTIMIZER_CHECK:
        _OPTIMIZER_CHECK.append(register_optimizer_step_pre_hook(_refuse_replaced_parameters))


def _rebind_parameters(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], new: dict[int, nn.Parameter]) -> None:
    """Replace parameters everywhere they are referenced: owning modules (tied ones too), the flat
    weight lists of RNN modules, and optimizer. Installs the check that refuses another optimizer's
    step over the replaced ones (:func:`_refuse_replaced_parameters`)."""
    _install_optimizer_check()
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
                    for _, holder in optimizer_state.holders(optimizer):
                        if old in holder.state:
                            holder.state[new[id(old)]] = holder.state.pop(old)


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
            parameter or buffer is sparse or nested (not ``torch.strided``); a DTensor parameter was
            assigned through ``.data =`` since the last call (the values were lost); a trainable
            embedding has ``sparse=True`` (:func:`_refuse_sparse_gradients`).
    """
    _refuse_sparse_gradients(model)
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for fqn, t in named:
            if nn.parameter.is_lazy(t):
                raise PlanError(
                    f"{kind} {fqn!r} of {type(model).__name__} is uninitialized (a lazy module, e.g. nn.LazyLinear, "
                    f"creates it on its first call), so it has no shape to place: run the model once on one batch "
                    f"before the first step (as torch's DDP and FSDP require), e.g. `with torch.no_grad(): model(x)`"
                )
            not_dense = not_dense_problem(t)
            if not_dense is not None:
                raise PlanError(f"{kind} {fqn!r} of {type(model).__name__} {not_dense}")
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
        plain = [
            (p, st, key, v)
            for _, holder in optimizer_state.holders(optimizer)
            for p, st in holder.state.items()
            for key, v in st.items()
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
        ]
        if plain and not new:
            # States loaded since the model was converted (optimizer.load_state_dict of plain tensors).
            check_state_distribution(f"the step distributes {len(plain)} plain optimizer states (loaded)", mesh)
        for p, st, key, v in plain:
            st[key] = _distribute(v, mesh, plan.state_placements(fqn_of[id(p)], p, v))
    if new:
        # Buffers stay plain tensors, replicated: every rank must hold rank 0's values (a rank that
        # differs would silently compute another model), so they are broadcast along with the
        # parameters, as DDP does at construction.
        for b in model.buffers():
            if not isinstance(b, DTensor) and not b.is_meta:
                local = distribute_tensor(b, mesh, replicate(mesh)).to_local()
                # A buffer whose size-1 dims give it other strides than its contiguous form (the
                # PositionalEncoding of torch's examples: pe.unsqueeze(0).transpose(0, 1)) comes back as
                # a view of itself; copy_ refuses overlapping memory.
                if local.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                    local = local.clone()
                b.copy_(local)
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
    loaded = [
        (fqn, param, value)
        # Every name of a shared parameter (a tied head): the state dict holds each one.
        for fqn, param in module.named_parameters(remove_duplicate=False)
        if isinstance(param, DTensor)
        and type(value := state_dict.get(prefix + fqn)) is torch.Tensor
        and value.shape == param.shape
    ]
    if loaded:
        check_state_distribution(
            f"model.load_state_dict distributes {len(loaded)} loaded tensors ({loaded[0][0]}, ...)", loaded[0][1].device_mesh
        )
    for fqn, param, value in loaded:
        source = value.detach().to(device=param.to_local().device, copy=True)
        state_dict[prefix + fqn] = _distribute(source, param.device_mesh, param.placements)


def _refuse_sparse_gradients(model: nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` give their weight a sparse
    gradient for ``SparseAdam`` / sparse SGD. A compiled step computes it dense (DTensor has no sparse
    placements), so a sparse optimizer would fail inside the trace with its own error and
    ``p.grad.is_sparse`` would change; refused before anything is converted, naming the module.
    """
    for fqn, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
            raise PlanError(
                f"{type(module).__name__} {fqn or '(root)'} has sparse=True: its weight's gradient would be a "
                f"sparse tensor, which spmd_expand does not produce (gradients are dense DTensors)\n"
                f"  fix: construct it with sparse=False (the default) and a dense optimizer (AdamW instead of "
                f"SparseAdam, which updates only the rows a batch reads)"
            )


# Models spmd.compile converted, whose forward refuses plain tensors outside a step (:func:`_refuse_eager_call`).
_EAGER_CALLS_REFUSED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def refuse_eager_calls(model: nn.Module) -> None:
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


def adopt_replaced_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
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


def check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
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
