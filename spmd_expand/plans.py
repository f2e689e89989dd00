"""Parallel plans: which placement every input of the traced step starts with.

A plan is a style for a 1-D mesh or a dict ``{mesh_dim_name: style}`` for an N-D mesh. Each style says,
for its own mesh dim, the placement of parameters, gradients, optimizer states and batch tensors.
:func:`resolve_plan` combines the styles of all mesh dims into per-tensor placement tuples, which is
all later stages see.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Placement, Replicate, Shard

from .boundaries import TP_STYLES, BoundaryLayouts, style_layouts
from .errors import PlanError

__all__ = [
    "ParallelStyle",
    "DDP",
    "FSDP",
    "TensorParallel",
    "Plan",
    "ResolvedPlan",
    "ParamCast",
    "MixedPrecision",
    "resolve_plan",
    "fqn_matches",
    "block_of",
]

_INDEX = re.compile(r"^\d+$")


def block_of(fqn: str) -> str:
    """The block a parameter belongs to: its FQN up to and including the first numeric component
    (``layers.3.attn.q.weight`` -> ``layers.3``: one element of an ``nn.ModuleList``/``Sequential``),
    or ``""``, the root block, for parameters outside such lists (embeddings, final norm, head).

    The unit FSDP2 users wrap with ``fully_shard`` (each transformer block, then the root): FSDP's
    buckets (:mod:`spmd_expand.passes.bucketing`) and its ``reshard_after_forward`` default follow it.
    """
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return ""


class ParallelStyle:
    """A plan for one mesh dim. Subclasses say where each kind of tensor lives on that dim."""

    def param_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        raise NotImplementedError

    def batch_placement(self, tensor: torch.Tensor) -> Placement:
        raise NotImplementedError

    def compute_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        """Where the module reads the parameter; by default where it is stored."""
        return self.param_placement(fqn, param)

    def reduces_grad(self, fqn: str) -> bool:
        """False for parameters whose gradients stay rank-local (e.g. DDP's ignored modules)."""
        return True

    def reshards_after_forward(self, fqn: str) -> bool:
        """Whether parameter ``fqn``, gathered for forward, is freed after it and gathered again for
        backward (FSDP's ``reshard_after_forward``); False: the gathered copy is kept."""
        return False

    def mixed_precision(self, fqn: str) -> Optional[MixedPrecisionPolicy]:
        """The mixed-precision policy parameter ``fqn`` is read and reduced with; None: its own dtype."""
        return None

    def bind(self, model: nn.Module) -> None:
        """Resolve module references against the model being compiled."""

    def check_mesh(self, mesh: DeviceMesh) -> None:
        """Refuse options the mesh's device type cannot honour (raises PlanError)."""


def _ignored_fqns(model: nn.Module, ignored: Iterable[Union[nn.Module, str]]) -> frozenset[str]:
    """Parameter FQNs owned by the given modules (objects or module FQNs)."""
    modules = dict(model.named_modules())
    by_id = {id(m): name for name, m in modules.items()}
    prefixes = []
    for m in ignored:
        if isinstance(m, str):
            if m not in modules:
                raise PlanError(f"ignored_modules names {m!r}, which is not a submodule of {type(model).__name__}")
            prefixes.append(m)
        elif id(m) in by_id:
            prefixes.append(by_id[id(m)])
        else:
            raise PlanError(f"ignored_modules holds a {type(m).__name__} that is not a submodule of the model")
    fqns = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        if any(p == "" or name == p or name.startswith(p + ".") for p in prefixes):
            fqns.add(name)
    return frozenset(fqns)


def _check_mp_policy(style: ParallelStyle) -> None:
    policy = style.mp_policy
    if policy is None:
        return
    if not isinstance(policy, MixedPrecisionPolicy):
        raise PlanError(
            f"{type(style).__name__}(mp_policy=...) takes a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(policy).__module__}.{type(policy).__name__}\n  fix: MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            f"reduce_dtype=torch.float32) (FSDP1's MixedPrecision is not this class)"
        )
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise PlanError(f"{type(style).__name__}: MixedPrecisionPolicy.{name}={dtype!r} is not a floating-point torch.dtype")


class _DataParallel(ParallelStyle):
    """Batch split on ``batch_dim``; parameters of ``ignored_modules`` keep rank-local gradients and
    their own dtype."""

    batch_dim: int
    ignored_modules: tuple
    mp_policy: Optional[MixedPrecisionPolicy]
    _ignored: frozenset

    def bind(self, model: nn.Module) -> None:
        self._ignored = _ignored_fqns(model, self.ignored_modules)
        _check_mp_policy(self)

    def mixed_precision(self, fqn: str) -> Optional[MixedPrecisionPolicy]:
        return None if fqn in self._ignored else self.mp_policy

    def batch_placement(self, tensor: torch.Tensor) -> Placement:
        if tensor.dim() <= self.batch_dim:
            return Replicate()
        return Shard(self.batch_dim)

    def reduces_grad(self, fqn: str) -> bool:
        return fqn not in self._ignored


@dataclass
class DDP(_DataParallel):
    """Data parallel (``torch.nn.parallel.DistributedDataParallel`` semantics).

    Parameters and optimizer states are ``Replicate()``; batch tensors are ``Shard(batch_dim)``; each
    gradient is all-reduced once per step, where the optimizer reads it, so a mean loss over the global
    batch gives the same averaged gradients as one device.

    Args:
        batch_dim: dim of every batch tensor that is split across ranks.
        ignored_modules: modules (objects or FQNs) whose parameters are left out of gradient reduction.
            As in DDP, their gradients stay rank-local and every rank updates its own copy, so these
            parameters may drift apart across ranks and are not covered by the single-device promise.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``, as for :class:`FSDP`: the module
            computes with parameters cast to ``param_dtype`` and gradients are all-reduced in
            ``reduce_dtype``. ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` alone is DDP's
            ``bf16_compress_hook`` (``register_comm_hook``): fp32 compute, gradients all-reduced in bf16
            (half the bytes), then cast back to the parameter's dtype.
    """

    batch_dim: int = 0
    ignored_modules: tuple = ()
    mp_policy: Optional[MixedPrecisionPolicy] = None
    _ignored: frozenset = field(default=frozenset(), init=False, repr=False)

    def param_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        return Replicate()


@dataclass
class FSDP(_DataParallel):
    """Fully sharded data parallel (ZeRO-3, ``torch.distributed.fsdp.fully_shard`` semantics).

    Parameters, gradients and optimizer states are ``Shard(0)`` (dims that do not divide by the mesh
    size are split unevenly, as DTensor does); each parameter is all-gathered where the module reads
    it, gradients are reduce-scattered once per step, and the optimizer updates only the local shard.
    Batch tensors are ``Shard(batch_dim)``.

    Args:
        batch_dim: dim of every batch tensor that is split across ranks.
        reshard_after_forward: ``fully_shard``'s option, with its default. ``True``: free the gathered
            parameters after forward and all-gather them again for backward (less memory, one more
            all-gather per parameter); ``False``: keep them. ``None`` (default): ``True`` for the
            parameters of blocks (:func:`block_of`: an element of an ``nn.ModuleList``/``Sequential``)
            and ``False`` for the root block's (embeddings, final norm, head), as FSDP2 does for its
            root module, "since for training, the parameters would be freed and all-gathered
            immediately" (``torch.distributed.fsdp._fully_shard._fsdp_state``): backward starts
            with them. A model without such lists is all root block: nothing is re-gathered.
        ignored_modules: modules (objects or FQNs) whose parameters are not sharded: they stay
            replicated and their gradients rank-local, as FSDP's ``ignored_params``.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` with ``fully_shard``'s semantics:
            sharded parameters, gradients and optimizer states keep the parameters' dtype (fp32);
            each parameter is cast to ``param_dtype`` on its shard, *then* all-gathered (the
            all-gather moves ``param_dtype``); its gradient is cast to ``reduce_dtype`` (default:
            ``param_dtype``), reduce-scattered in that dtype at the end of each backward, and cast
            back to the parameter's dtype for the optimizer. ``cast_forward_inputs`` casts the root
            module's floating-point inputs to ``param_dtype``; ``output_dtype`` casts its
            floating-point outputs. Buffers keep their dtype (as in FSDP2). None: no casts.
        modules: module FQN globs (matched as :func:`fqn_matches` matches, e.g. ``"layers.*"``), or
            None for the whole model. Parameters of the matched modules and their descendants are
            sharded as above; every other parameter is ``Replicate()`` with its gradient all-reduced
            (DDP), as ``fully_shard`` on the chosen modules composed with ``replicate`` on the rest.
            A tied parameter is sharded when any module holding it matches.
        offload_policy: torch's ``torch.distributed.fsdp.OffloadPolicy`` / ``CPUOffloadPolicy``. On a
            CPU mesh it is accepted and changes nothing: sharded parameters, gradients and optimizer
            states already live in CPU memory. ``OffloadPolicy()`` (torch's "no offload") is accepted
            on any mesh.

    Raises:
        PlanError: a ``modules`` glob matches no submodule; ``offload_policy`` is not an
            ``OffloadPolicy``, or is a ``CPUOffloadPolicy`` on a non-CPU mesh (offload of device
            meshes is not implemented yet).
    """

    batch_dim: int = 0
    reshard_after_forward: Optional[bool] = None
    ignored_modules: tuple = ()
    mp_policy: Optional[MixedPrecisionPolicy] = None
    modules: Optional[Union[str, Iterable[str]]] = None
    offload_policy: Optional[object] = None
    _ignored: frozenset = field(default=frozenset(), init=False, repr=False)
    _sharded: Optional[frozenset] = field(default=None, init=False, repr=False)

    def bind(self, model: nn.Module) -> None:
        super().bind(model)
        self._sharded = None if self.modules is None else _fqns_under(model, self.modules, "FSDP modules")

    def check_mesh(self, mesh: DeviceMesh) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        policy = self.offload_policy
        if policy is not None and not isinstance(policy, OffloadPolicy):
            raise PlanError(
                f"FSDP offload_policy must be a torch.distributed.fsdp.OffloadPolicy or CPUOffloadPolicy, got "
                f"{type(policy).__name__}"
            )
        if isinstance(policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
            raise PlanError(
                f"FSDP offload_policy=CPUOffloadPolicy(): CPU offload is not implemented for device meshes on "
                f"{mesh.device_type!r} yet; drop the offload_policy option (parameters, gradients and optimizer "
                f"states stay sharded in {mesh.device_type} memory)"
            )

    def param_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        if fqn in self._ignored or param.dim() == 0 or (self._sharded is not None and fqn not in self._sharded):
            return Replicate()
        return Shard(0)

    def compute_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        return Replicate()

    def reshards_after_forward(self, fqn: str) -> bool:
        if self.reshard_after_forward is None:
            return block_of(fqn) != ""
        return bool(self.reshard_after_forward)


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether module FQN ``fqn`` matches plan key ``pattern``, as ``parallelize_module`` matches.

    Both split on ``"."`` and match atom by atom with :func:`fnmatch.fnmatchcase`, so ``*`` stands for
    one name (``"layers.*.attn"`` matches ``layers.0.attn``, not ``layers.0.block.attn``).
    """
    atoms, names = pattern.split("."), fqn.split(".") if fqn else []
    return len(atoms) == len(names) and all(fnmatch.fnmatchcase(n, a) for a, n in zip(atoms, names))


def _fqns_under(model: nn.Module, globs: Union[str, Iterable[str]], what: str) -> frozenset[str]:
    """Parameter FQNs (as ``named_parameters()`` names them) held by a module matching one of
    ``globs`` (:func:`fqn_matches`) or by its descendants; a tied parameter counts when any holder
    matches.

    Raises:
        PlanError: a glob matches no submodule.
    """
    globs = (globs,) if isinstance(globs, str) else tuple(globs)
    names = [name for name, _ in model.named_modules()]
    prefixes = []
    for pattern in globs:
        matched = [name for name in names if fqn_matches(pattern, name)]
        if not matched:
            raise PlanError(
                f"{what} glob {pattern!r} matches no submodule of {type(model).__name__}; globs match module "
                f"FQNs from model.named_modules() atom by atom ('layers.*' matches 'layers.0', not 'layers.0.attn')"
            )
        prefixes.extend(matched)
    held = {
        id(p)
        for fqn, p in model.named_parameters(remove_duplicate=False)
        if any(fqn.startswith(prefix + ".") for prefix in prefixes)
    }
    return frozenset(fqn for fqn, p in model.named_parameters() if id(p) in held)


class TensorParallel(ParallelStyle):
    """Tensor parallel (Megatron-LM, Shoeybi et al. 2019), with torch's own TP styles.

    ``plan`` maps module FQN globs (``"layers.*.attn.q_proj"``, matched as ``parallelize_module``
    does, see :func:`fqn_matches`) to ``torch.distributed.tensor.parallel`` styles. Parameter
    placements on this mesh dim follow those styles (as ``parallelize_module`` places them):

    ==============================  =========================  ===========================
    style                           ``nn.Linear``              ``nn.Embedding``
    ==============================  =========================  ===========================
    ``ColwiseParallel``             weight, bias ``Shard(0)``  weight ``Shard(1)``
    ``RowwiseParallel``             weight ``Shard(1)``,       weight ``Shard(0)``
                                    bias ``Replicate()``       (vocab-parallel embedding)
    ``SequenceParallel``            ``Replicate()``            ``Replicate()``
    ``PrepareModuleInput``,         (hold no parameters; any module, with or without parameters)
    ``PrepareModuleOutput``,
    ``PrepareModuleInputOutput``
    ==============================  =========================  ===========================

    Parameters no glob names are ``Replicate()``. The batch is replicated over this dim (TP ranks
    pass the same batch). Module inputs and outputs are brought to the layouts the style asks for
    where the module is called (see :mod:`spmd_expand.boundaries`); ``use_local_output`` has no
    meaning for a whole-step graph (the step always sees global tensors) and is ignored.

    Use :meth:`from_huggingface` to build the plan a HuggingFace ``transformers`` model declares.

    Raises:
        PlanError: a glob matches no module or a module matches two globs, a style is not one of
            the above, ``ColwiseParallel`` / ``RowwiseParallel`` names a module that is not an
            ``nn.Linear`` or ``nn.Embedding`` (torch refuses those too), a layout is not
            ``Replicate()`` / ``Shard(dim)``, or a tied parameter would get two different placements.
    """

    def __init__(self, plan: Mapping[str, object]):
        for pattern, style in plan.items():
            if not isinstance(style, TP_STYLES):
                raise PlanError(
                    f"TensorParallel entry {pattern!r}: {type(style).__name__} is not one of "
                    f"{', '.join(s.__name__ for s in TP_STYLES)}"
                )
        self.plan = dict(plan)
        self._param_placements: dict[str, Placement] = {}
        self._module_styles: dict[str, object] = {}
        self._modules: dict[str, nn.Module] = {}

    @classmethod
    def from_huggingface(cls, model: nn.Module, overrides: Optional[Mapping[str, object]] = None) -> "TensorParallel":
        """The plan a HuggingFace ``transformers`` model declares for itself, as torch styles.

        See :func:`spmd_expand.hf_plan.huggingface_tp_plan` for where the plan is read and how each
        HF style string maps to a torch style. ``overrides`` (FQN glob -> HF string or torch style)
        replace or add entries, e.g. ``{"lm_head": ColwiseParallel(output_layouts=Shard(-1))}`` for a
        vocab-sharded head under ``loss_parallel()``.

        Raises:
            PlanError: the model declares no plan, or uses a style string with no torch equivalent.
        """
        from .hf_plan import huggingface_tp_plan

        return cls(huggingface_tp_plan(model, overrides))

    def __repr__(self) -> str:
        entries = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in self.plan.items())
        return f"TensorParallel({{{entries}}})"

    def bind(self, model: nn.Module) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        modules = dict(model.named_modules())
        matched: dict[str, str] = {}
        for pattern in self.plan:
            names = [name for name in modules if fqn_matches(pattern, name)]
            if not names:
                raise PlanError(f"TensorParallel glob {pattern!r} matches no submodule of {type(model).__name__}")
            for name in names:
                if name in matched:
                    raise PlanError(
                        f"submodule {name!r} matches both {matched[name]!r} and {pattern!r}; give each module "
                        f"one style (PrepareModuleInputOutput combines input and output layouts)"
                    )
                matched[name] = pattern
        self._module_styles = {name: self.plan[pattern] for name, pattern in matched.items()}
        self._modules = {name: modules[name] for name in self._module_styles}
        for name, style in self._module_styles.items():
            if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(modules[name], (nn.Linear, nn.Embedding)):
                raise PlanError(
                    f"{type(style).__name__} on {name!r}: torch's style shards nn.Linear and nn.Embedding, not "
                    f"{type(modules[name]).__name__}; name its Linear submodules, or use PrepareModuleInput/Output "
                    f"for layouts only"
                )
        placements: dict[int, tuple[Placement, str]] = {}
        canonical = {id(p): fqn for fqn, p in model.named_parameters()}
        for fqn, param in model.named_parameters(remove_duplicate=False):
            module_fqn, _, name = fqn.rpartition(".")
            placement = _tp_placement(self._module_styles.get(module_fqn), modules[module_fqn], name)
            seen = placements.setdefault(id(param), (placement, fqn))
            if seen[0] != placement:
                raise PlanError(
                    f"tied parameter {canonical[id(param)]!r} is {seen[0]} as {seen[1]!r} but {placement} as "
                    f"{fqn!r}; {_tied_fix(modules, seen[1], fqn)}"
                )
        self._param_placements = {canonical[pid]: pl for pid, (pl, _) in placements.items()}
        self.module_layouts()  # refuses unsupported layouts now, not in the middle of tracing

    def param_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        return self._param_placements.get(fqn, Replicate())

    def batch_placement(self, tensor: torch.Tensor) -> Placement:
        return Replicate()

    def module_layouts(self) -> dict[str, BoundaryLayouts]:
        """Module FQN -> the layouts its style asks for at its inputs and outputs on this mesh dim,
        for the modules the plan names (after :meth:`bind`)."""
        return {fqn: style_layouts(style, self._modules[fqn], fqn) for fqn, style in self._module_styles.items()}


def _tied_fix(modules: Mapping[str, nn.Module], *fqns: str) -> str:
    """The fix for a tied parameter two TP styles place differently (``fqns``: its two names)."""
    holders = [fqn.rpartition(".")[0] for fqn in fqns]
    unshardable = [h for h in holders if not isinstance(modules[h], (nn.Linear, nn.Embedding))]
    if unshardable:
        # A parameter a non-Linear module holds itself (BERT's ``cls.predictions.bias``) stays
        # replicated: no torch style shards it, so neither may the other holder's.
        h = unshardable[0]
        other = next(x for x in holders if x != h) if len(set(holders)) > 1 else h
        return (
            f"{h!r} ({type(modules[h]).__name__}) holds it itself and no torch style shards a parameter of a "
            f"module that is not nn.Linear or nn.Embedding, so it stays replicated: leave {other!r} without a "
            f"sharding style (replicated), or untie the two"
        )
    return "give both modules styles that place it the same way"


def _tp_placement(style: Optional[object], module: nn.Module, name: str) -> Placement:
    """Placement of parameter ``name`` of ``module`` under TP ``style`` (see TensorParallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, nn.Embedding) and name == "weight":
        if isinstance(style, ColwiseParallel):
            return Shard(1)
        if isinstance(style, RowwiseParallel):
            return Shard(0)
    elif isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return Shard(0)
        if isinstance(style, RowwiseParallel):
            return Shard(1) if name == "weight" else Replicate()
    return Replicate()


Plan = Union[ParallelStyle, Mapping[str, ParallelStyle]]


@dataclass(frozen=True)
class ParamCast:
    """How the step reads one parameter under mixed precision (FSDP2's ``MixedPrecisionPolicy``).

    The module computes with the parameter cast to ``param_dtype`` (cast on the stored shard, so an
    FSDP all-gather moves ``param_dtype``); its gradient is cast to ``reduce_dtype``, reduced per the
    plan in that dtype, and cast back to the parameter's own dtype.
    """

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype


@dataclass(frozen=True)
class MixedPrecision:
    """The plan's mixed precision for one model: a :class:`ParamCast` per parameter FQN that needs
    one, and the policy whose ``cast_forward_inputs``/``output_dtype`` apply at the root module."""

    casts: Mapping[str, ParamCast]
    policy: MixedPrecisionPolicy


@dataclass(frozen=True)
class ResolvedPlan:
    """Per-tensor placement tuples (one entry per mesh dim) for a plan on a mesh."""

    mesh: DeviceMesh
    styles: tuple[ParallelStyle, ...]

    @property
    def data_parallel_dims(self) -> list[int]:
        """The mesh dims of the plan's DDP/FSDP styles."""
        return [m for m, s in enumerate(self.styles) if isinstance(s, _DataParallel)]

    def param_placements(self, fqn: str, param: torch.Tensor) -> tuple[Placement, ...]:
        return tuple(s.param_placement(fqn, param) for s in self.styles)

    def batch_placements(self, tensor: torch.Tensor) -> tuple[Placement, ...]:
        return tuple(s.batch_placement(tensor) for s in self.styles)

    def compute_placements(self, fqn: str, param: torch.Tensor) -> tuple[Placement, ...]:
        return tuple(s.compute_placement(fqn, param) for s in self.styles)

    def reshards_after_forward(self, fqn: str) -> bool:
        """Whether any mesh dim's style frees parameter ``fqn`` after forward (see
        :meth:`ParallelStyle.reshards_after_forward`)."""
        return any(s.reshards_after_forward(fqn) for s in self.styles)

    def mixed_precision(self, model: nn.Module) -> Optional[MixedPrecision]:
        """The casts the styles' ``mp_policy`` asks for on ``model``'s parameters; None without a policy.

        A parameter's policy comes from the styles that give one (FSDP on one mesh dim, DDP on
        another: the same policy, or a PlanError); ``reduce_dtype`` defaults to ``param_dtype``, and
        ``param_dtype`` to the parameter's own dtype. Non-floating parameters are never cast.

        Raises:
            PlanError: two mesh dims' styles give different policies.
        """
        policies = {s.mp_policy for s in self.styles if getattr(s, "mp_policy", None) is not None}
        if not policies:
            return None
        if len(policies) > 1:
            raise PlanError(
                f"the plan's styles give different mixed-precision policies {sorted(map(str, policies))}; give "
                f"every mesh dim's style the same mp_policy (or one style only)"
            )
        casts = {}
        for fqn, param in model.named_parameters():
            chosen = {s.mixed_precision(fqn) for s in self.styles} - {None}
            if not chosen or not param.dtype.is_floating_point:
                continue
            (policy,) = chosen
            param_dtype = policy.param_dtype or param.dtype
            reduce_dtype = policy.reduce_dtype or param_dtype
            if param_dtype != param.dtype or reduce_dtype != param.dtype:
                casts[fqn] = ParamCast(param_dtype, reduce_dtype)
        return MixedPrecision(casts, next(iter(policies)))

    def module_layouts(self) -> dict[str, list[tuple[int, BoundaryLayouts]]]:
        """Module FQN -> [(mesh dim, :class:`~spmd_expand.boundaries.BoundaryLayouts`)] for
        tensor-parallel styles."""
        layouts: dict[str, list] = {}
        for mesh_dim, style in enumerate(self.styles):
            if isinstance(style, TensorParallel):
                for fqn, boundary in style.module_layouts().items():
                    layouts.setdefault(fqn, []).append((mesh_dim, boundary))
        return layouts

    def grad_placements(self, fqn: str, param: torch.Tensor) -> tuple[Placement, ...] | None:
        """Placements a gradient is reduced to, or None where it stays rank-local on some mesh dim."""
        if not all(s.reduces_grad(fqn) for s in self.styles):
            return None
        return self.param_placements(fqn, param)

    def state_placements(self, fqn: str, param: torch.Tensor, state: torch.Tensor) -> tuple[Placement, ...]:
        """Optimizer states shaped like their parameter follow it; scalars (e.g. ``step``) are replicated."""
        if tuple(state.shape) == tuple(param.shape):
            return self.param_placements(fqn, param)
        return tuple(Replicate() for _ in self.styles)


def resolve_plan(plan: Plan, mesh: DeviceMesh, model: nn.Module) -> ResolvedPlan:
    """Order the plan's styles by mesh dim and bind them to ``model``.

    Raises:
        PlanError: a dict plan whose keys are not exactly the mesh's dim names, or a single style on
            an N-D mesh.
    """
    if isinstance(plan, ParallelStyle):
        if mesh.ndim != 1:
            raise PlanError(
                f"a single {type(plan).__name__} needs a 1-D mesh, got {mesh.ndim}-D mesh with dims "
                f"{mesh.mesh_dim_names}; pass a dict {{mesh_dim_name: style}}"
            )
        styles = (plan,)
    elif isinstance(plan, Mapping):
        names = mesh.mesh_dim_names
        if names is None or set(plan) != set(names):
            raise PlanError(f"plan keys {sorted(plan)} must equal the mesh dim names {names}")
        styles = tuple(plan[n] for n in names)
    else:
        raise PlanError(f"plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    for s in styles:
        if not isinstance(s, ParallelStyle):
            raise PlanError(f"plan entry {s!r} is not a ParallelStyle (spmd.DDP, ...)")
        s.bind(model)
        s.check_mesh(mesh)
    return ResolvedPlan(mesh, styles)
