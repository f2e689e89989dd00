"""Parallel plans: which placement every input of the traced step starts with.

A plan is a style for a 1-D mesh or a dict ``{mesh_dim_name: style}`` for an N-D mesh. Each style says,
for its own mesh dim, the placement of parameters, gradients, optimizer states and batch tensors.
:func:`resolve_plan` combines the styles of all mesh dims into per-tensor placement tuples, which is
all later stages see.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from .errors import PlanError

__all__ = ["ParallelStyle", "DDP", "FSDP", "TensorParallel", "Plan", "ResolvedPlan", "resolve_plan"]


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

    # Whether gathered parameters are freed after forward and gathered again for backward.
    reshard_after_forward: bool = False

    def bind(self, model: nn.Module) -> None:
        """Resolve module references against the model being compiled."""


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


class _DataParallel(ParallelStyle):
    """Batch split on ``batch_dim``; parameters of ``ignored_modules`` keep rank-local gradients."""

    batch_dim: int
    ignored_modules: tuple
    _ignored: frozenset

    def bind(self, model: nn.Module) -> None:
        self._ignored = _ignored_fqns(model, self.ignored_modules)

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
    """

    batch_dim: int = 0
    ignored_modules: tuple = ()
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
        reshard_after_forward: free the gathered parameters after forward and all-gather them again
            for backward (less memory, one more all-gather per parameter); ``False`` keeps them.
        ignored_modules: modules (objects or FQNs) whose parameters are not sharded: they stay
            replicated and their gradients rank-local, as FSDP's ``ignored_params``.
    """

    batch_dim: int = 0
    reshard_after_forward: bool = True
    ignored_modules: tuple = ()
    _ignored: frozenset = field(default=frozenset(), init=False, repr=False)

    def param_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        if fqn in self._ignored or param.dim() == 0:
            return Replicate()
        return Shard(0)

    def compute_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        return Replicate()


class TensorParallel(ParallelStyle):
    """Tensor parallel (Megatron-LM, Shoeybi et al. 2019), with torch's own TP styles.

    ``plan`` maps globs over the FQNs of parameter-owning modules (``"layers.*.attn.q_proj"``, matched
    with :func:`fnmatch.fnmatchcase`) to ``torch.distributed.tensor.parallel`` styles. Parameter
    placements on this mesh dim follow those styles (as ``parallelize_module`` places them):

    =====================  =========================  ===========================
    style                  ``nn.Linear``              ``nn.Embedding``
    =====================  =========================  ===========================
    ``ColwiseParallel``    weight, bias ``Shard(0)``  weight ``Shard(1)``
    ``RowwiseParallel``    weight ``Shard(1)``,       weight ``Shard(0)``
                           bias ``Replicate()``       (vocab-parallel embedding)
    ``SequenceParallel``   ``Replicate()``            ``Replicate()``
    =====================  =========================  ===========================

    Parameters no glob names are ``Replicate()``. The batch is replicated over this dim (TP ranks
    pass the same batch). Module inputs and outputs are brought to the style's layouts
    (``desired_input_layouts`` / ``output_layouts``; ``SequenceParallel``: ``Shard(sequence_dim)``)
    where the module is called; ``use_local_output`` has no meaning for a whole-step graph (the step
    always sees global tensors) and is ignored.

    Raises:
        PlanError: a glob matches no module, a style is not a Colwise/Rowwise/SequenceParallel, or a
            tied parameter would get two different placements.
    """

    def __init__(self, plan: Mapping[str, object]):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        for pattern, style in plan.items():
            if not isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)):
                raise PlanError(
                    f"TensorParallel entry {pattern!r}: {type(style).__name__} is not ColwiseParallel, "
                    f"RowwiseParallel or SequenceParallel"
                )
        self.plan = dict(plan)
        self._param_placements: dict[str, Placement] = {}
        self._module_styles: dict[str, object] = {}
        self._modules: dict[str, nn.Module] = {}

    def __repr__(self) -> str:
        entries = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in self.plan.items())
        return f"TensorParallel({{{entries}}})"

    def style_of(self, module_fqn: str) -> Optional[object]:
        """The TP style whose glob matches ``module_fqn`` first, or None."""
        for pattern, style in self.plan.items():
            if fnmatch.fnmatchcase(module_fqn, pattern):
                return style
        return None

    def bind(self, model: nn.Module) -> None:
        modules = dict(model.named_modules())
        for pattern in self.plan:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in modules):
                raise PlanError(f"TensorParallel glob {pattern!r} matches no submodule of {type(model).__name__}")
        self._module_styles = {name: s for name in modules if (s := self.style_of(name)) is not None}
        self._modules = {name: modules[name] for name in self._module_styles}
        placements: dict[int, tuple[Placement, str]] = {}
        canonical = {id(p): fqn for fqn, p in model.named_parameters()}
        for fqn, param in model.named_parameters(remove_duplicate=False):
            module_fqn, _, name = fqn.rpartition(".")
            placement = _tp_placement(self._module_styles.get(module_fqn), modules[module_fqn], name)
            seen = placements.setdefault(id(param), (placement, fqn))
            if seen[0] != placement:
                raise PlanError(
                    f"tied parameter {canonical[id(param)]!r} is {seen[0]} as {seen[1]!r} but {placement} as "
                    f"{fqn!r}; give both modules styles that place it the same way"
                )
        self._param_placements = {canonical[pid]: pl for pid, (pl, _) in placements.items()}

    def param_placement(self, fqn: str, param: torch.Tensor) -> Placement:
        return self._param_placements.get(fqn, Replicate())

    def batch_placement(self, tensor: torch.Tensor) -> Placement:
        return Replicate()

    def module_layouts(self) -> dict[str, tuple[Optional[str], Optional[str]]]:
        """Module FQN -> (input, output) placement on this mesh dim, in the ``layout`` marker's
        encoding (``"R"``, ``"S<dim>"``), for the modules the plan names (after :meth:`bind`)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        layouts = {}
        for fqn, style in self._module_styles.items():
            if isinstance(style, ColwiseParallel):
                layouts[fqn] = (_encode(style.desired_input_layouts[0]), _encode(style.output_layouts[0]))
            elif isinstance(style, RowwiseParallel):
                # Where the module is called the input is brought to what the local op needs, as
                # RowwiseParallel's input hook does: split features for a Linear, indices whole for
                # an Embedding.
                wanted = "R" if isinstance(self._modules[fqn], nn.Embedding) else "S-1"
                layouts[fqn] = (wanted, _encode(style.output_layouts[0]))
            else:  # SequenceParallel
                layouts[fqn] = (_encode(style.sequence_sharding[0]),) * 2
        return layouts


def _encode(placement: Placement) -> str:
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    raise PlanError(f"tensor-parallel layouts must be Replicate() or Shard(dim), got {placement}")


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
class ResolvedPlan:
    """Per-tensor placement tuples (one entry per mesh dim) for a plan on a mesh."""

    mesh: DeviceMesh
    styles: tuple[ParallelStyle, ...]

    def param_placements(self, fqn: str, param: torch.Tensor) -> tuple[Placement, ...]:
        return tuple(s.param_placement(fqn, param) for s in self.styles)

    def batch_placements(self, tensor: torch.Tensor) -> tuple[Placement, ...]:
        return tuple(s.batch_placement(tensor) for s in self.styles)

    def compute_placements(self, fqn: str, param: torch.Tensor) -> tuple[Placement, ...]:
        return tuple(s.compute_placement(fqn, param) for s in self.styles)

    @property
    def reshard_after_forward(self) -> bool:
        return any(s.reshard_after_forward for s in self.styles)

    def module_layouts(self) -> dict[str, list[tuple[int, Optional[str], Optional[str]]]]:
        """Module FQN -> [(mesh dim, input placement, output placement)] for tensor-parallel styles."""
        layouts: dict[str, list] = {}
        for mesh_dim, style in enumerate(self.styles):
            if isinstance(style, TensorParallel):
                for fqn, (inp, out) in style.module_layouts().items():
                    layouts.setdefault(fqn, []).append((mesh_dim, inp, out))
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
    return ResolvedPlan(mesh, styles)
