"""Layouts at module boundaries: what tensor-parallel styles ask of a module's inputs and outputs.

torch's styles (``torch/distributed/tensor/parallel/style.py``) act in forward hooks: a pre-hook turns
the module's inputs into DTensors with ``input_layouts`` and redistributes them to the layouts the
module needs (``desired_input_layouts``); a post-hook does the same for outputs. In a whole-step graph
every value is a global tensor whose placement propagation already knows, so the ``input_layouts``
annotation has nothing to add: only the layout a value is *brought to* matters. :func:`style_layouts`
turns a style into those target layouts (:class:`BoundaryLayouts`), and :func:`mark_boundaries` puts a
``spmd_expand::layout`` marker (see :func:`spmd_expand.ops.layout`) on each of them while the step is
traced; propagation then redistributes there, as the style's hook would. Gradients of module outputs
come back in the output's layout (in eager DTensor the backward of the output redistribution does
that); gradients of inputs flow on as propagation places them, so that e.g. the partial input
gradients of q/k/v projections are summed before one reduction. ``use_local_output`` has no meaning
here: the step always sees global tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Mapping, Optional, Sequence

import torch
import torch.utils._pytree as pytree
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from . import ops
from .errors import PlanError, TraceError, node_error, user_source_line

__all__ = [
    "BoundaryLayouts", "style_layouts", "mark_boundaries", "encode_placement", "TP_STYLES", "mark_sequence_first",
    "refuse_split_sequences",
]


def _tp_styles() -> tuple[type, ...]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    return (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)


TP_STYLES: tuple[type, ...] = _tp_styles()
"""The ``torch.distributed.tensor.parallel`` styles a tensor-parallel plan accepts."""


@dataclass(frozen=True)
class BoundaryLayouts:
    """Target placements (on one mesh dim) at one module's boundary; None leaves a value as it is.

    ``inputs`` are by position among the forward's positional arguments, ``kwargs`` by keyword,
    ``outputs`` by position in a tuple output (a single tensor output is position 0). With
    ``exact_inputs`` / ``exact_outputs`` the module must be called with exactly that many positional
    arguments / return exactly that many outputs (torch's ``PrepareModuleInput`` / ``PrepareModuleOutput``
    raise otherwise); without, the layouts apply to the first positions (``ColwiseParallel`` and the
    other parameter styles read ``inputs[0]``).
    """

    inputs: tuple[Optional[Placement], ...] = ()
    kwargs: tuple[tuple[str, Placement], ...] = ()
    outputs: tuple[Optional[Placement], ...] = ()
    exact_inputs: bool = False
    exact_outputs: bool = False


def encode_placement(placement: Placement, where: str) -> str:
    """``Replicate()`` -> ``"R"``, ``Shard(d)`` -> ``"S<d>"``: the ``layout`` marker's encoding.

    Raises:
        PlanError: any other placement (``Partial`` cannot be asked for: a module boundary can
            reduce a value but not make one unreduced; ``_StridedShard`` is not a layout a style names).
    """
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Shard) and not isinstance(placement, _StridedShard):
        return f"S{placement.dim}"
    raise PlanError(f"{where}: tensor-parallel layouts must be Replicate() or Shard(dim), got {placement}")


def _target(given: Optional[Placement], desired: Optional[Placement]) -> Optional[Placement]:
    # torch (PrepareModuleInput._prepare_input_arg): no given layout leaves the value alone; no
    # desired layout keeps the given one, i.e. the module sees the value in that layout.
    if given is None:
        return None
    return desired if desired is not None else given


def _as_tuple(layouts: Any) -> tuple:
    if layouts is None:
        return ()
    return (layouts,) if isinstance(layouts, Placement) else tuple(layouts)


def style_layouts(style: object, module: nn.Module, fqn: str) -> BoundaryLayouts:
    """The layouts torch's ``style`` brings ``module``'s inputs and outputs to.

    ====================================  ==========================================  =====================
    style                                 inputs                                      outputs
    ====================================  ==========================================  =====================
    ``ColwiseParallel``                   ``inputs[0]`` ``Replicate()``               ``output_layouts``
    ``RowwiseParallel``                   ``inputs[0]`` ``Shard(-1)`` (Linear),       ``output_layouts``
                                          ``Replicate()`` (Embedding)
    ``SequenceParallel``                  ``inputs[0]`` ``Shard(sequence_dim)``       ``Shard(sequence_dim)``
    ``PrepareModuleInput``                ``desired_input_layouts`` (or, where None,  --
                                          ``input_layouts``; nothing where
                                          ``input_layouts`` is None), by position
                                          and keyword
    ``PrepareModuleOutput``               --                                          ``desired_output_layouts``
    ``PrepareModuleInputOutput``          as ``PrepareModuleInput``                   as ``PrepareModuleOutput``
    ====================================  ==========================================  =====================

    Raises:
        PlanError: ``style`` is not one of these, or names a placement other than ``Replicate()`` /
            ``Shard(dim)`` as a target.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    where = f"{type(style).__name__} on {fqn!r}"
    if isinstance(style, ColwiseParallel):
        layouts = BoundaryLayouts(inputs=(Replicate(),), outputs=(style.output_layouts[0],))
    elif isinstance(style, RowwiseParallel):
        # RowwiseParallel picks its desired input when applied: split features for a Linear, whole
        # indices for an Embedding (style.py, RowwiseParallel._apply).
        wanted = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        layouts = BoundaryLayouts(inputs=(wanted,), outputs=(style.output_layouts[0],))
    elif isinstance(style, SequenceParallel):
        layouts = BoundaryLayouts(inputs=style.sequence_sharding, outputs=style.sequence_sharding)
    elif isinstance(style, PrepareModuleInputOutput):
        inputs = style_layouts(style.prepare_module_input, module, fqn)
        outputs = style_layouts(style.prepare_module_output, module, fqn)
        layouts = BoundaryLayouts(
            inputs=inputs.inputs, kwargs=inputs.kwargs, outputs=outputs.outputs, exact_inputs=inputs.exact_inputs, exact_outputs=True
        )
    elif isinstance(style, PrepareModuleInput):
        given, desired = _as_tuple(style.input_layouts), _as_tuple(style.desired_input_layouts)
        kwargs = tuple(
            (key, target)
            for key in sorted(set(style.input_kwarg_layouts) | set(style.desired_input_kwarg_layouts))
            if (target := _target(style.input_kwarg_layouts.get(key), style.desired_input_kwarg_layouts.get(key))) is not None
        )
        layouts = BoundaryLayouts(
            inputs=tuple(_target(g, d) for g, d in zip(given, desired)), kwargs=kwargs, exact_inputs=style.input_layouts is not None
        )
    elif isinstance(style, PrepareModuleOutput):
        given, desired = _as_tuple(style.output_layouts), _as_tuple(style.desired_output_layouts)
        layouts = BoundaryLayouts(outputs=tuple(_target(g, d) for g, d in zip(given, desired)), exact_outputs=True)
    else:
        raise PlanError(f"{where}: not a torch.distributed.tensor.parallel style spmd_expand accepts ({', '.join(s.__name__ for s in TP_STYLES)})")
    for p in (*layouts.inputs, *(p for _, p in layouts.kwargs), *layouts.outputs):
        if p is not None:
            encode_placement(p, where)
    return layouts


def _mark(value: Any, marks: Sequence[tuple[int, Placement]], what: str, output: bool = False) -> Any:
    if not marks:
        return value
    if not isinstance(value, torch.Tensor):
        raise TraceError(f"{what} is a {type(value).__name__}, but the plan gives it a layout; give it None in the style")
    if isinstance(value, DTensor):
        # A model from spmd.parallelize, traced by Dynamo: the style's own redistribution, which the
        # spmd backend reads back as these markers (spmd_expand.backend).
        placements = list(value.placements)
        for mesh_dim, placement in marks:
            encode_placement(placement, what)
            placements[mesh_dim] = Shard(placement.dim % value.ndim) if isinstance(placement, Shard) else placement
        return value.redistribute(placements=placements)
    for mesh_dim, placement in marks:
        encoded = encode_placement(placement, what)
        # An output's gradient comes back in the output's layout, as the backward of the style's
        # redistribution gives it in eager DTensor (e.g. RowwiseParallel: replicated, not partial).
        value = ops.layout(value, mesh_dim, encoded, encoded if output else "")
    return value


def _positional(values: tuple, layouts: Sequence[tuple[int, BoundaryLayouts]], field: str, exact: str, what: str) -> tuple:
    out = list(values)
    for mesh_dim, lay in layouts:
        targets = getattr(lay, field)
        if getattr(lay, exact) and len(targets) != len(values):
            raise TraceError(
                f"{what}: the plan gives {len(targets)} layouts but the module has {len(values)} "
                f"(torch's style requires one per {'positional input' if field == 'inputs' else 'output'}, None for those left alone)"
            )
        for i, p in enumerate(targets[: len(values)]):
            if p is not None:
                out[i] = _mark(out[i], [(mesh_dim, p)], f"{what}, position {i}", output=field == "outputs")
    return tuple(out)


@contextlib.contextmanager
def mark_boundaries(model: nn.Module, layouts: Mapping[str, Sequence[tuple[int, BoundaryLayouts]]]) -> Iterator[None]:
    """While active, the named submodules' inputs and outputs pass through ``layout`` markers.

    Args:
        model: the traced model.
        layouts: module FQN -> ``[(mesh dim, BoundaryLayouts)]``.

    Raises (while tracing):
        TraceError: a value a layout names is not a tensor, or a style that needs one layout per
            input/output meets a module called with another number of them.
    """
    modules = dict(model.named_modules())
    handles = []
    for fqn, entries in layouts.items():

        def pre(module, args, kwargs, fqn=fqn, entries=entries):
            what = f"input of {fqn or type(module).__name__!r}"
            args = _positional(args, entries, "inputs", "exact_inputs", what)
            kwargs = dict(kwargs)
            for mesh_dim, lay in entries:
                for key, p in lay.kwargs:
                    if key in kwargs:
                        kwargs[key] = _mark(kwargs[key], [(mesh_dim, p)], f"{what} {key!r}")
            return args, kwargs

        def post(module, args, output, fqn=fqn, entries=entries):
            what = f"output of {fqn or type(module).__name__!r}"
            if isinstance(output, tuple):  # as torch's output hooks: a tuple's entries by position
                values = _positional(output, entries, "outputs", "exact_outputs", what)
                return type(output)(*values) if hasattr(output, "_fields") else type(output)(values)
            return _positional((output,), entries, "outputs", "exact_outputs", what)[0]

        handles.append(modules[fqn].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(modules[fqn].register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _sequence_first_inputs(module: nn.Module) -> tuple[str, ...]:
    """The forward arguments of ``module`` that hold the sequence on dim 0, or () when it has none:
    ``nn.MultiheadAttention``'s query, key and value and the input of ``nn.RNN``/``LSTM``/``GRU``, when
    built with ``batch_first=False`` (their default, and ``nn.Transformer*``'s)."""
    if getattr(module, "batch_first", True):
        return ()
    if isinstance(module, nn.MultiheadAttention):
        return ("query", "key", "value")
    if isinstance(module, nn.RNNBase):
        return ("input",)
    return ()


def _split_sequence_dims(placements: Sequence[Placement], ndim: int, mesh: Any, data_parallel_dims: Sequence[int]) -> list[int]:
    """The data-parallel mesh dims (of size > 1) that split dim 0 of a value with ``placements``."""
    return [
        m for m in data_parallel_dims
        if mesh.size(m) > 1 and isinstance(placements[m], (Shard, _StridedShard)) and placements[m].dim % max(ndim, 1) == 0
    ]


def _split_sequence_problem(fqn: str, mesh: Any, split: Sequence[int], gathered_by: Optional[fx.Node] = None) -> tuple[str, str]:
    """(problem, fix) of a sequence-first module whose sequence dim the mesh dims ``split`` split, or,
    with ``gathered_by``, whose input that node gathered from the batch split across them."""
    names = mesh.mesh_dim_names
    where = ", ".join(repr(names[m]) if names else f"mesh dim {m}" for m in split)
    if gathered_by is None:
        how = f"the plan splits that dim across the data-parallel ranks ({where})"
    else:
        how = (
            f"it is computed from the step's batch, split across the data-parallel ranks ({where}) and gathered "
            f"by {gathered_by.target} ({user_source_line(gathered_by)}), e.g. to slice the split dim"
        )
    problem = (
        f"module {fqn!r} (batch_first=False) reads dim 0 of its input as the sequence, and {how}: "
        f"the ranks' local batches would be joined into longer sequences, not into more samples, unlike one "
        f"device over the global batch"
    )
    fix = (
        "pass sequence-first batches with the plan's batch_dim=1 (e.g. spmd.DDP(batch_dim=1), when every batch "
        "tensor of the step has its samples on dim 1), or pass batch-first tensors and transpose them inside the "
        "step or the model (`x.transpose(0, 1)`), or build the module with batch_first=True"
    )
    if gathered_by is not None:
        fix += "; if the step gathers the batch on purpose, slice it outside the step (each rank its own samples)"
    return problem, fix


@contextlib.contextmanager
def mark_sequence_first(model: nn.Module, mesh: Any = None, data_parallel_dims: Sequence[int] = ()) -> Iterator[None]:
    """While active, the sequence-first inputs of ``model``'s modules (:func:`_sequence_first_inputs`)
    pass through ``spmd_expand::sequence_first`` markers (:func:`spmd_expand.ops.sequence_first`), so
    that :func:`refuse_split_sequences` can see how the plan places them. A tensor passed as several of
    them (self-attention's ``x, x, x``) is marked once and passed as the same object, as
    ``multi_head_attention_forward`` tells self-attention apart by identity.

    A DTensor input (a model from ``spmd.parallelize``, traced by Dynamo) has its placements already:
    it is checked here against ``mesh``'s ``data_parallel_dims`` instead of marked.

    Raises (while the model runs):
        PlanError: a DTensor input whose dim 0 a data-parallel mesh dim splits.
    """
    handles = []
    for fqn, module in model.named_modules():
        names = _sequence_first_inputs(module)
        if not names:
            continue

        def pre(module, args, kwargs, fqn=fqn, names=names):
            marked: dict[int, torch.Tensor] = {}

            def mark(value: Any) -> Any:
                if isinstance(value, DTensor):
                    split = _split_sequence_dims(value.placements, value.ndim, mesh, data_parallel_dims) if mesh else []
                    if split:
                        problem, fix = _split_sequence_problem(fqn, mesh, split)
                        raise PlanError(f"{problem}\n  input placements: {value.placements}\n  fix: {fix}")
                    return value
                if not isinstance(value, torch.Tensor):
                    return value  # e.g. a PackedSequence
                if id(value) not in marked:
                    marked[id(value)] = ops.sequence_first(value, fqn)
                return marked[id(value)]

            args = tuple(mark(a) if i < len(names) else a for i, a in enumerate(args))
            kwargs = {k: mark(v) if k in names else v for k, v in kwargs.items()}
            return args, kwargs

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def refuse_split_sequences(
    gm: Any, mesh: Any, data_parallel_dims: Sequence[int], batch_inputs: Collection[fx.Node] = ()
) -> None:
    """Refuse a data-parallel split of a sequence-first module's dim 0 (its sequence, not its batch).

    torch's DDP never splits a tensor: each rank feeds its own samples, whatever their layout. Here the
    plan's ``batch_dim`` (0 by default) says along which dim the ranks' batches join into the global
    one. With sequence-first data (``(seq, batch, ...)``, as ``nn.LSTM``/``nn.Transformer`` take by
    default) and ``batch_dim=0``, the global program would run each module on the ranks' sequences
    joined end to end, a different computation from one device's over more samples. Such a model runs
    only where that dim is not split by a data-parallel mesh dim.

    Args:
        gm: the global graph, after propagation (``node.meta["spmd"]``).
        mesh: the plan's device mesh.
        data_parallel_dims: the mesh dims of the plan's DDP/FSDP styles.
        batch_inputs: the placeholders of the step's batch tensors. A module input computed from them
            but not split where they are was gathered on the way (``data[:-1]`` of sequence-first tokens
            under ``batch_dim=0`` slices the split dim): refused too, as the same join.

    Raises:
        PlanError: naming the module, its input's placements, the source line and the fix.
    """
    splitting = [m for m in data_parallel_dims if mesh.size(m) > 1]
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not ops.SEQUENCE_FIRST:
            continue
        spec = node.meta["spmd"].inputs[0]
        split = _split_sequence_dims(spec.placements, len(spec.tensor_meta.shape), mesh, data_parallel_dims)
        if split:
            problem, fix = _split_sequence_problem(node.args[1], mesh, split)
            raise node_error(PlanError, node, problem, placements=spec.placements, fix=fix)
        unsplit = [m for m in splitting if not isinstance(spec.placements[m], (Shard, _StridedShard))]
        gather = _batch_gathered_before(node.args[0], batch_inputs, unsplit) if unsplit else None
        if gather is not None:
            problem, fix = _split_sequence_problem(node.args[1], mesh, unsplit, gathered_by=gather)
            raise node_error(PlanError, node, problem, placements=spec.placements, fix=fix)


def _batch_gathered_before(value: fx.Node, batch_inputs: Collection[fx.Node], mesh_dims: Sequence[int]) -> Optional[fx.Node]:
    """The node, among ``value`` and its ancestors, that reads a value computed from ``batch_inputs``
    and split by one of ``mesh_dims`` as unsplit on that mesh dim (DTensor gathers it there, e.g. to
    slice the split dim); None if there is none."""
    ancestors, stack = set(), [value]
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    from_batch = set(batch_inputs)
    for node in value.graph.nodes:  # topological order: every producer before its readers
        if node not in ancestors or node in from_batch:
            continue
        read = [a for a in node.all_input_nodes if a in from_batch]
        if not read:
            continue
        from_batch.add(node)
        sharding = node.meta.get("spmd")
        if sharding is None or not sharding.inputs:
            continue
        leaves, _ = pytree.tree_flatten((node.args, node.kwargs))
        for arg, wanted in zip(leaves, sharding.inputs):
            produced = arg.meta["spmd"].output if arg in read else None
            if isinstance(produced, DTensorSpec) and wanted is not None and any(
                isinstance(produced.placements[m], (Shard, _StridedShard))
                and not isinstance(wanted.placements[m], (Shard, _StridedShard))
                for m in mesh_dims
            ):
                return node
    return None
