"""What a compiled step depends on, checked on every call: the cache key, the batch check, and the
optimizer state created before tracing.

A compiled graph bakes in the structure of the model, the optimizer and the batch. Everything it bakes
in is either a graph input (tensors, the float hyperparameters of the optimizer's param groups and the
step's float arguments) or
part of :func:`cache_key` / a hyperparameter guard (``trace.HyperParameterGuards``), so a call whose
state differs from the traced one compiles again instead of running a stale graph:

=======================================  ==================================================
graph input (no recompilation)           parameters, buffers, gradients, optimizer states,
                                         batch tensors, every float setting of every param
                                         group (``lr``, ``betas``, ``weight_decay``, ``eps``,
                                         ``momentum``, ...; also a 0-d tensor ``lr``), every
                                         float argument of the step (``trace.FloatArgument``)
recompiles                               another model, optimizer or submodule object
                                         (a swapped activation); ``train()`` /
                                         ``eval()`` of any submodule; ``requires_grad`` of any
                                         parameter; param groups (members, non-float settings
                                         such as ``foreach``, ``nesterov``, ``amsgrad``);
                                         optimizer state keys and non-tensor state; batch
                                         shapes and dtypes; gradient sync on/off; non-tensor,
                                         non-float arguments of the step; a hyperparameter or
                                         float argument value that
                                         breaks an assumption of the traced code (e.g.
                                         ``weight_decay`` from 0 to non-zero, or any value a
                                         fused kernel took as a constant); a Python value
                                         the trace read: a module attribute ``forward``
                                         reads, a global or closure variable of the step,
                                         an attribute of a settings object (a HuggingFace
                                         ``config``, ``args``, the step's ``self``) it read
                                         (``python_values.PythonGuards``); torch's global
                                         state (``torch.autocast``, default dtype, ...); a
                                         hook added or removed (module, parameter, optimizer,
                                         global)
refused (``TraceError``)                 a tensor the step was not handed (a global tensor,
                                         another module's); Python state the step changes
                                         and Python/numpy randomness or torch seeding in the
                                         step (``trace.trace_step``, at trace time)
refused (``BatchError``)                 local batches of different shapes on different ranks
                                         (uneven or empty), a batch tensor without the plan's
                                         batch dim, batch tensors of different sizes along it,
                                         non-tensor arguments that differ between ranks,
                                         replicated batch tensors (tensor-parallel ranks,
                                         0-d arguments) whose values differ between ranks
                                         (on calls that compile or select a graph; 0-d
                                         tensors and float arguments on every call)
refused (``DivergenceError``)            hyperparameter values that differ between ranks
                                         (an LR scheduler stepped on rank 0 only); ranks
                                         about to run different compiled graphs (``eval()``
                                         on rank 0 only); default generators in different
                                         states when the step draws random numbers
=======================================  ==================================================
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from . import optimizer_state
from .errors import BatchError, CollectiveError, DivergenceError, SpmdError, first_line
from .plans import ResolvedPlan
from .python_values import MODULE_HOOKS, TENSOR_HOOKS, hooks
from .rng import GENERATOR_FIX
from .trace import FloatArgument, FloatConstant, HyperParameter
from .watch import is_communication_failure

__all__ = [
    "CallState", "ObjectIds", "PendingCheck", "Snapshot", "batch_problems", "cache_key", "check_batch", "initialize_optimizer_state",
    "mesh_group", "overlapping_batch_leaves", "snapshot", "start_check", "state_summary",
]


class ObjectIds:
    """Small serial numbers for objects, held weakly: a new model or optimizer gets a new number even
    if it reuses a dead object's ``id``."""

    def __init__(self) -> None:
        self._ids: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def __call__(self, obj: Any) -> Optional[int]:
        if obj is None:
            return None
        if obj not in self._ids:
            self._ids[obj] = len(self._ids) + 1 + max(self._ids.values(), default=0)
        return self._ids[obj]


def _setting(value: Any) -> Any:
    """A hashable stand-in for a param-group setting that is not a hyperparameter input."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_setting(v) for v in value)
    return value if isinstance(value, (int, str, bool, type(None))) else repr(value)


def cache_key(
    ids: ObjectIds,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    hyperparameters: Sequence[HyperParameter],
    inputs: tuple,
    constants: tuple,
    gradient_sync: bool,
    structure: Any = None,
) -> tuple:
    """Everything a traced graph depends on besides its inputs and hyperparameter guards.

    ``inputs`` is the per-input (role, global spec, placements) tuple of the call; ``structure`` the
    pytree structure of the step's arguments (batch inputs are numbered by leaf: a dict's keys in
    another order are other inputs).
    """
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    # Which module objects make up the model: a module without parameters (an activation) swapped
    # for another changes the graph as much as a new parameter does.
    modules = tuple((ids(m), type(m), m.training) for m in model.modules())
    requires_grad = tuple(p.requires_grad for p in model.parameters())
    groups: tuple = ()
    state: tuple = ()
    if optimizer is not None:
        floats = {(hp.group, hp.key) for hp in hyperparameters if isinstance(hp, HyperParameter)}
        groups = tuple(
            (
                tuple(fqn_of.get(id(p), "?") for p in g["params"]),
                tuple(
                    (k, type(v).__name__ if (i, k) in floats else _setting(v))
                    for k, v in sorted(g.items(), key=lambda kv: kv[0])
                    if k != "params"
                ),
            )
            for i, g in enumerate(optimizer.param_groups)
        )
        state = tuple(
            (fqn_of.get(id(p), "?"), tuple((k, _setting(v)) for k, v in st.items() if not isinstance(v, torch.Tensor)))
            for p, st in optimizer_state.items(optimizer)
        )
    hook_objects, hook_counts = hooks(list(model.modules()), list(model.parameters()), optimizer)
    hook_key = (tuple(id(h) if isinstance(h, dict) else ids(h) for h in hook_objects), tuple(hook_counts))
    return (ids(model), ids(optimizer), modules, requires_grad, groups, state, inputs, constants, gradient_sync, hook_key, structure)


@dataclass
class Snapshot:
    """What :func:`cache_key` and the graph's inputs depend on, cheap to take and compare on every call.

    ``objects`` are compared by identity (model, optimizer, every module and its class, parameter and
    its local tensor, buffer, hook, param group and its members, state dict); ``values`` by equality
    (``training`` of every module, ``requires_grad``, whether a gradient exists, parameter and buffer
    shapes, the number of slots of every module, non-float param-group settings and the type of float
    ones, state keys); ``states`` (every optimizer state value) tensors by identity and the rest by
    value (:func:`_setting`).
    Two equal snapshots of the same model and optimizer give the same :func:`cache_key` and the same
    graph input roles. Taking one walks the module tree once with no names and builds each list in
    C-level ``map``/``attrgetter`` passes (``bench/call_overhead.py`` measures a call); comparing is
    C-level identity and equality, except ``states`` when a state object changed (e.g. an int
    ``step``), compared one by one.
    """

    objects: list
    values: list
    states: list

    def same_as(self, other: "Snapshot") -> bool:
        return (
            len(self.objects) == len(other.objects)
            and all(map(operator.is_, self.objects, other.objects))
            and self.values == other.values
            and len(self.states) == len(other.states)
            and (all(map(operator.is_, self.states, other.states)) or all(map(_same_state, self.states, other.states)))
        )


def _same_state(a: Any, b: Any) -> bool:
    """Whether two optimizer state values are the same for the graph: a tensor only itself (the graph
    updates it in place; another object is new state), anything else by value."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return _setting(a) == _setting(b)


def _setting_kind(value: Any) -> Any:
    """A param-group setting as :func:`cache_key` sees it: float values are inputs, only their type counts."""
    if isinstance(value, float):
        return float
    if isinstance(value, tuple):
        return tuple(_setting_kind(v) for v in value)
    return _setting(value)


_SLOTS = operator.attrgetter("_parameters", "_buffers", "_modules")
_TRAINING = operator.attrgetter("training")
_PARAM_VALUES = operator.attrgetter("requires_grad", "shape")
_BUFFER_VALUES = operator.attrgetter("shape", "dtype")
_GRAD = operator.attrgetter("grad")


def snapshot(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Snapshot:
    """Take the :class:`Snapshot` of ``model`` and ``optimizer`` (see there)."""
    # A tensor subclass's properties (a DTensor's or Parameter's ``shape``, ``grad``, hooks) go
    # through its ``__torch_function__`` (a Python call each, disabled or not); read them as torch's
    # own attributes instead: the same values, half the time of a call for DTensor parameters.
    with torch._C.DisableTorchFunctionSubclass():
        return _snapshot(model, optimizer)


def _snapshot(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Snapshot:
    modules = []
    stack = [model]
    while stack:
        module = stack.pop()
        modules.append(module)
        stack.extend(c for c in reversed(module._modules.values()) if c is not None)
    slots = list(map(_SLOTS, modules))
    params = [p for slot in slots for p in slot[0].values() if p is not None]
    buffers = [b for slot in slots for b in slot[1].values() if b is not None]
    objects: list = [model, optimizer, *modules, *map(type, modules), *params, *buffers]
    # A DTensor parameter's local tensor (``swap_tensors`` replaces it); a plain one itself.
    objects += [getattr(p, "_local_tensor", p) for p in params]
    values: list = list(map(_TRAINING, modules))
    # Its storage: ``p.data = ...`` swaps it (and for a DTensor nothing else; api refuses that).
    values += [p.untyped_storage()._cdata for p in params]
    values += [tuple(map(len, slot)) for slot in slots]
    values += map(_PARAM_VALUES, params)
    values += map(operator.is_, map(_GRAD, params), itertools.repeat(None))
    values += map(_BUFFER_VALUES, buffers)
    hook_objects, hook_counts = hooks(modules, params, optimizer)
    objects += hook_objects
    values += hook_counts
    states: list = []
    if optimizer is not None:
        groups = optimizer.param_groups
        objects += [groups, *groups]
        for group in groups:
            objects += group["params"]
            values.append(len(group["params"]))
            values += [(key, _setting_kind(value)) for key, value in group.items() if key != "params"]
        found = [holder for _, holder in optimizer_state.holders(optimizer)]
        for holder in found:
            objects.append(holder.state)
            objects += holder.state.keys()
        held = list(itertools.chain.from_iterable(holder.state.values() for holder in found))
        objects += held
        values += map(tuple, held)
        states = list(itertools.chain.from_iterable(map(dict.values, held)))
    return Snapshot(objects, values, states)


_LAYOUT_PROBLEM = "not dense: tensor argument"
_GRAD_PROBLEM = "requires grad: tensor argument"


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor (``torch.strided``, not nested): the only kind DTensor (torch
    2.13) places."""
    return t.layout == torch.strided and not t.is_nested


def overlapping_batch_leaves(leaves: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Pairs ``(i, j)``, ``i < j``, of tensor arguments whose memory overlaps: one tensor passed twice
    (``step(model, opt, x, x)``), or overlapping views of one (``x[:, :-1], x[:, 1:]``). By storage and
    byte range (conservative for interleaved strides); in O(len(leaves)) where no two share a storage,
    the usual case."""
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(leaves):
        if is_dense(t) and t.numel() and t.device.type != "meta":
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    pairs = []
    for same in by_storage.values():
        for a, i in enumerate(same):
            pairs += [(i, j) for j in same[a + 1:] if _bytes_overlap(leaves[i], leaves[j])]
    return tuple(pairs)


def _bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    def extent(t: torch.Tensor) -> tuple[int, int]:
        last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def not_dense_problem(t: torch.Tensor) -> Optional[str]:
    """What keeps ``t`` from being placed (a sparse or nested tensor, :func:`is_dense`) and the fix;
    None for a dense tensor."""
    if is_dense(t):
        return None
    if t.is_nested:
        return (
            f"is a nested tensor (layout {t.layout}): DTensor places dense tensors (torch.strided) only; pad the "
            f"sequences to one length (`t.to_padded_tensor(0.0)`, with a mask where padding must not count)"
        )
    return (
        f"has layout {t.layout}: DTensor places dense tensors (torch.strided) only; store it dense "
        f"(`t.to_dense()`: a sparse matmul such as `torch.sparse.mm(adj, x)` then runs as `adj @ x`)"
    )


def batch_problems(leaves: Sequence[torch.Tensor], plan: ResolvedPlan, mesh: DeviceMesh) -> list[str]:
    """This rank's own problems with its batch tensors (no communication)."""
    problems = []
    sizes: dict[int, tuple[int, int]] = {}  # tensor dim -> (size, first argument with it)
    for i, t in enumerate(leaves):
        not_dense = not_dense_problem(t)
        if not_dense is not None:
            problems.append(f"{_LAYOUT_PROBLEM} {i} {not_dense}")
            continue
        if t.requires_grad:
            problems.append(
                f"{_GRAD_PROBLEM} {i}: the compiled step takes its tensor arguments as data (they "
                f"are traced as not requiring grad, and no gradient flows back to what computed them, such as "
                f"another model's output); pass `t.detach()`, and to differentiate with respect to the input "
                f"inside the step (an input-gradient penalty, an adversarial example) call "
                f"`x = x.detach().requires_grad_()` there"
            )
        for style in plan.styles:
            batch_dim = getattr(style, "batch_dim", None)
            if batch_dim is not None and 0 < t.dim() <= batch_dim:
                problems.append(
                    f"tensor argument {i} has shape {tuple(t.shape)}, which has no batch dim {batch_dim} "
                    f"({type(style).__name__}(batch_dim={batch_dim}))"
                )
        for placement in plan.batch_placements(t):
            if isinstance(placement, Shard):
                size = t.shape[placement.dim]
                first = sizes.setdefault(placement.dim, (size, i))
                if size == 0:
                    problems.append(f"tensor argument {i} is empty on batch dim {placement.dim} (shape {tuple(t.shape)})")
                elif first[0] != size:
                    problems.append(
                        f"tensor arguments {first[1]} and {i} have {first[0]} and {size} rows on batch dim "
                        f"{placement.dim}; every tensor argument is split along it "
                        + _uneven_rows_fix(t, plan, mesh, placement.dim, first, i)
                    )
    return problems


def _uneven_rows_fix(t: torch.Tensor, plan: ResolvedPlan, mesh: DeviceMesh, dim: int, first: tuple[int, int], i: int) -> str:
    """The likely cause of two batch arguments with different row counts, and its fix."""
    mesh_dims = [m for m, p in enumerate(plan.batch_placements(t)) if isinstance(p, Shard) and p.dim == dim]
    pieces = math.prod(mesh.size(m) for m in mesh_dims)
    if t.shape[dim] == first[0] * pieces:
        # Returned tensors are global (spmd.compile's contract), so state carried from one call to the
        # next (an RNN's hidden state) comes back with every rank's rows.
        index = f"mesh.get_local_rank({mesh_dims[0]})" if len(mesh_dims) == 1 else "this rank's data-parallel index"
        return (
            f"(argument {i} has the rows of all {pieces} data-parallel ranks: a tensor an earlier call returned? "
            f"Returned tensors are the single-device value; pass this rank's rows, "
            f"`t.tensor_split({pieces}, dim={dim})[{index}]`, or keep state carried across calls in a module "
            f"buffer updated in place)"
        )
    return (
        "(pass per-step constants such as class weights as module buffers: model.register_buffer(name, tensor); "
        "for sequence-first data (seq, batch, ...) beside per-sample targets, pass batch-first tensors and "
        "transpose them inside the step, or make every batch tensor sequence-first and set the plan's batch_dim=1)"
    )


_SUBMESH_GROUPS: dict[tuple, Any] = {}


def mesh_group(mesh: DeviceMesh):
    """A process group over all ranks of ``mesh``.

    Not ``DeviceMesh._flatten()``: flattening a 2-D mesh changed how DTensor redistributed on it
    afterwards (FSDP+TP parameters came out wrong) in torch 2.13.
    """
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    key = (ranks, id(dist.group.WORLD))
    if key not in _SUBMESH_GROUPS:  # every rank of the job reaches this on the same (first) call
        _SUBMESH_GROUPS[key] = dist.new_group(list(ranks))
    return _SUBMESH_GROUPS[key]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass
class CallState:
    """What every rank's call of a compiled step must agree on besides its batch (:func:`check_batch`).

    Attributes:
        constants: the ``repr`` of each non-tensor argument of the step.
        hyperparameters: each float setting of the optimizer's param groups (graph inputs) ...
        values: ... and its value in this call.
        graph: the digest of the compiled graph this call runs
            (:attr:`~spmd_expand.pipeline.StepArtifacts.graph_digest`); None when it compiles a new one.
        model, optimizer: read only to explain a difference in ``graph`` (:func:`state_summary`).
        generator: the default generator's state (:func:`~spmd_expand.rng.generator_state`) when the
            graph draws random numbers, else None.
        check_values: compare the values of replicated batch tensors across the ranks that replicate
            them (:func:`replicated_values`); set on the full path (a call that compiles or selects a
            graph), where a device synchronization costs nothing that matters.
        distributes: set (with no batch) by :func:`check_state_distribution`: what this rank is about to
            send from rank 0 to every rank, outside a step.
        step: the compiled step function this call runs (module and qualified name), None outside a step.
        tensor_constants: ``(label, digest)`` of each tensor the step reads from elsewhere (a graph
            input, replicated: :class:`~spmd_expand.python_values.TensorConstant`;
            :func:`value_digest`), compared on every call.
    """

    constants: tuple = ()
    hyperparameters: Sequence[HyperParameter] = ()
    values: Sequence[float] = ()
    graph: Optional[int] = None
    model: Optional[nn.Module] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    generator: Optional[str] = None
    check_values: bool = False
    distributes: Optional[str] = None
    step: Optional[str] = None
    tensor_constants: tuple = ()


def check_batch(leaves: Sequence[torch.Tensor], plan: Optional[ResolvedPlan], mesh: DeviceMesh, call: CallState = CallState()) -> None:
    """Check that every rank of ``mesh`` passes local batches of the same shapes and dtypes, and that
    the ranks agree on ``call``: the same non-tensor arguments, the same optimizer hyperparameter
    values, and the same compiled graph.

    Data-parallel ranks must hold equal parts of the global batch (DTensor's even split is what the
    compiled graph assumes) and tensor-parallel ranks the same batch. A non-tensor argument is a value
    of the one global program: a rank passing another one (a count of its own batch's tokens) would
    run a graph compiled for another value, with the same collectives, and nothing would notice. So
    is a hyperparameter (a graph input, not part of the graph): an LR scheduler stepped on one rank
    only would update the same parameters with different learning rates on different ranks. And two
    graphs compiled earlier for two states (``train()`` and ``eval()``) may issue collectives that
    match in count and kind: a rank left in ``eval()`` would run its graph against the others' without
    any error, exchanging unrelated values. The same holds for the default generator of a step that
    draws random numbers (``call.generator``), and, on calls that compile or select a graph
    (``call.check_values``), for the values of batch tensors a mesh dim replicates
    (:func:`replicated_values`; a 0-d tensor argument's value on every call). Costs one all-gather of
    7 int64 per call over the mesh's ranks, and
    one ``all_gather_object`` more where values are compared (skipped on torch's fake process group,
    which has one real process). A compiled step's calls that reuse the last call's graph issue the
    all-gather and run the graph's prologue while it is in flight (:func:`start_check`).

    Raises:
        BatchError: on every rank at once, naming each rank's shapes, arguments or problem, when ranks
            differ, a local batch is empty, a batch tensor lacks the batch dim, or tensors disagree on it,
            or a batch tensor is sparse or nested (:func:`not_dense_problem`; on one rank is enough).
        BatchError: also when ranks that replicate a batch tensor pass different values (a 0-d tensor
            argument: on every call).
        DivergenceError: on every rank at once, when the batches agree but the hyperparameter values
            (naming each differing setting and its values), the graphs (naming the model and
            optimizer settings that differ: :func:`state_summary`) or the generators differ.
        DivergenceError: first, when the ranks make different calls (``call.step``: an evaluation step
            on rank 0 only) or some ranks distribute loaded state (``call.distributes``) and others not.
    """
    pending = start_check(leaves, plan, mesh, call)
    if pending is not None:
        pending.finish()


def start_check(
    leaves: Sequence[torch.Tensor], plan: Optional[ResolvedPlan], mesh: DeviceMesh, call: CallState = CallState(),
    count: Optional[int] = None,
) -> Optional["PendingCheck"]:
    """:func:`check_batch` in two halves: issue the all-gather and return at once; the caller calls
    :meth:`PendingCheck.finish` (wait, compare, raise) before anything other ranks could see or the step
    cannot take back (the first collective, the first write into an input: :mod:`spmd_expand.prologue`).
    ``count``: an integer the ranks sum (:func:`~spmd_expand.prologue.folded_all_reduce`), sent in the
    row's last column (not compared; the column before says whether a rank sent one, and is);
    ``finish`` returns the sum.

    Returns None when nothing is pending: on torch's fake process group (a local problem raises here),
    or when this rank's batch has a problem already (then the whole check runs here and raises).
    """
    problems = batch_problems(leaves, plan, mesh)
    shapes = [(("nested",) if t.is_nested else tuple(t.shape), str(t.dtype)) for t in leaves]
    # An object's default repr names its address, which differs between processes.
    constants = tuple(_ADDRESS.sub("", c) for c in call.constants)
    if dist.get_backend() == "fake":
        if problems:
            raise BatchError("; ".join(problems))
        return None
    group = mesh_group(mesh)
    values = tuple(call.values)  # repr of a float round-trips: equal reprs, equal values
    # A 0-d tensor argument is one value of the program on every rank (a count, a mixup weight): compared
    # on every call, not only on calls that compile or select a graph (replicated_values), since a later
    # call may pass each rank's own value to a graph bound when they agreed.
    scalars = tuple((i, t.item()) for i, t in enumerate(leaves) if is_dense(t) and t.dim() == 0)
    digest = torch.tensor(
        [
            zlib.crc32(repr(shapes).encode()),
            len(leaves),
            int(bool(problems)),
            zlib.crc32(repr((constants, values, call.graph, call.generator, call.distributes, call.step, scalars, call.tensor_constants)).encode()),
            int(call.check_values),
            int(count is not None),
            count or 0,
        ],
        dtype=torch.int64,
        device=mesh.device_type,
    )
    gathered = torch.empty(dist.get_world_size(group) * 7, dtype=torch.int64, device=digest.device)
    try:
        work = dist.all_gather_single(gathered, digest, group=group, async_op=True)
    except Exception as e:
        if not is_communication_failure(e):
            raise
        raise _check_failed(e, group) from e
    pending = PendingCheck(work, gathered, group, leaves, plan, mesh, call, (shapes, problems, constants, values, scalars))
    if problems:  # the step cannot run on this batch: the verdict comes before anything else
        pending.finish()
        return None
    return pending


@dataclass
class PendingCheck:
    """The per-call check's all-gather, issued (:func:`start_check`); :meth:`finish` waits for it and
    compares the ranks' rows."""

    work: Any  # dist.Work
    gathered: torch.Tensor
    group: Any  # dist.ProcessGroup
    leaves: Sequence[torch.Tensor]
    plan: Optional[ResolvedPlan]
    mesh: DeviceMesh
    call: CallState
    local: tuple  # (shapes, problems, constants, values, scalars): this rank's side, for the report
    done: bool = False

    def finish(self) -> Optional[int]:
        """Wait for the all-gather; raise :func:`check_batch`'s errors when the ranks differ (on every rank
        at once: every rank sees the same rows). Once. Returns the sum of the ranks' ``count``, or None
        when a rank asked to compare replicated values (a call on the full path, which sends no count)."""
        assert not self.done, "the check was finished already"
        self.done = True
        try:
            self.work.wait()
        except Exception as e:
            if not is_communication_failure(e):
                raise
            raise _check_failed(e, self.group) from e
        return _verdict(self.gathered, self.group, self.leaves, self.plan, self.mesh, self.call, *self.local)


def _check_failed(error: Exception, group: Any) -> CollectiveError:
    return CollectiveError(
        f"rank {dist.get_rank()}: the batch check before the step (an all_gather of 7 int64 over the mesh's "
        f"ranks {dist.get_process_group_ranks(group)}) failed: {first_line(error)}. "
        f"Another rank failed or stopped calling the step (look for its error first; or its data loader ran "
        f"out first: give every rank the same number of batches, e.g. DistributedSampler, which pads to equal "
        f"lengths), or did not call it within the process group's timeout"
    )


def _verdict(gathered, group, leaves, plan, mesh, call, shapes, problems, constants, values, scalars) -> Optional[int]:
    rows = gathered.view(-1, 7).tolist()
    if all(row[:4] == rows[0][:4] for row in rows) and not rows[0][2]:
        if any(row[4] for row in rows):  # every rank sees it: all take part
            _check_replicated_values(leaves, plan, mesh, group)
            return None
        if any(row[5] != rows[0][5] for row in rows):
            raise SpmdError(
                "internal error: the ranks run the same compiled graph, but only some send a count in the "
                f"per-call check (ranks {dist.get_process_group_ranks(group)}: {[row[5] for row in rows]}; "
                "spmd_expand/prologue.py splits every rank's graph alike); nothing was updated. Please report it"
            )
        return sum(row[6] for row in rows)
    # Something differs: every rank learns the details, and every rank raises the same error.
    rows_agree = all(row[:3] == rows[0][:3] for row in rows) and not rows[0][2]  # column 3 differs
    summary = state_summary(call.model, call.optimizer) if rows_agree else None
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(
        reports,
        (shapes, problems, constants, values, call.graph, summary, call.generator, call.distributes, call.step, scalars, call.tensor_constants),
        group=group,
    )
    ranks = dist.get_process_group_ranks(group)
    if any(r[7] != reports[0][7] for r in reports):
        raise _one_sided_distribution(ranks, [r[7] for r in reports], [r[8] for r in reports])
    if any(r[8] != reports[0][8] for r in reports):
        raise _different_steps(ranks, [r[8] for r in reports])
    batches_agree = all(r[:2] == reports[0][:2] and not r[1] for r in reports)
    if batches_agree and all(r[2] == reports[0][2] for r in reports):
        if any(repr(r[9]) != repr(reports[0][9]) for r in reports):
            raise _different_scalars(leaves, mesh, ranks, [r[9] for r in reports])
        if any(r[10] != reports[0][10] for r in reports):
            raise _different_tensor_constants(ranks, [r[10] for r in reports])
        if any(repr(r[3]) != repr(reports[0][3]) for r in reports):
            raise _different_values(call.hyperparameters, ranks, [r[3] for r in reports])
        if any(r[4] != reports[0][4] for r in reports):
            raise _different_graphs(ranks, [r[4] for r in reports], [r[5] for r in reports])
        shown = "\n".join(f"  rank {rank}: {r[6]}" for rank, r in zip(ranks, reports))
        raise DivergenceError(
            "the ranks' random generators are in different states at the start of the step, which draws "
            "random numbers (dropout, noise):\n" + shown + "\n"
            "  each rank keeps its slice of one draw at the global size; from different states the slices "
            "come from different draws, not from the one draw one device makes (and replicated random values "
            "would differ between ranks); the step did not run, nothing was updated\n"
            f"  fix: {GENERATOR_FIX}"
        )
    reports = [r[:3] for r in reports]
    if batches_agree:
        shown = "\n".join(f"  rank {rank}: {', '.join(c)}" for rank, (_, _, c) in zip(ranks, reports))
        raise BatchError(
            "the ranks pass different non-tensor arguments to the step:\n" + shown + "\n"
            "  a compiled step is one program over the global batch, and a Python argument is one of its "
            "constants, the same on every rank\n"
            "  fix: pass every rank the same value; a value computed from a rank's own batch (a count of "
            "its tokens) is computed inside the step instead, where the batch is the global one "
            "(`(labels != -100).sum()` there counts the global batch's tokens)"
        )
    lines = []
    for rank, (rank_shapes, rank_problems, _) in zip(ranks, reports):
        shown = ", ".join(f"{tuple(s)} {d.replace('torch.', '')}" for s, d in rank_shapes)
        lines.append(f"  rank {rank}: {shown}" + "".join(f"\n    problem: {p}" for p in rank_problems))
    same_shapes = all(r[0] == reports[0][0] for r in reports)
    only_layouts = same_shapes and all(p.startswith(_LAYOUT_PROBLEM) for r in reports for p in r[1])
    only_grads = same_shapes and all(p.startswith(_GRAD_PROBLEM) for r in reports for p in r[1])
    raise BatchError(
        ("the step's batch tensors require grad:\n" if only_grads else
         "the step's batch tensors cannot be placed:\n" if only_layouts else
         "the ranks' local batches do not form a global batch this plan can split evenly:\n")
        + "\n".join(lines)
        + (
            "" if only_layouts or only_grads else
            "\n  fix: give every data-parallel rank the same number of rows (drop or pad the last, uneven "
            "batch, e.g. DataLoader(drop_last=True) with a DistributedSampler), and tensor-parallel ranks "
            "the same batch"
        )
    )


def check_state_distribution(what: str, mesh: DeviceMesh) -> None:
    """Before state loaded on this rank is sent from rank 0 to every rank (``what``: rank-independent
    words, e.g. "model.load_state_dict distributes 4 loaded tensors"), check that every rank of ``mesh``
    is about to do the same.

    Loading under ``if rank == 0:`` is a common habit from torch DDP (which broadcasts only at
    construction): here rank 0 would wait in the broadcast while the others run their next step, until
    the process group's timeout (30 minutes by default), and gloo's error would not say why. This is the
    per-call check's exchange (:func:`check_batch`, no batch), so it meets a peer's next step call
    there and both sides learn at once.

    Raises:
        DivergenceError: on every rank at once, when some ranks of ``mesh`` do something else (their
            next step call, another load), naming what each rank does and the fix; nothing was loaded.
    """
    check_batch((), None, mesh, CallState(distributes=what))


def _different_steps(ranks: Sequence[int], steps: Sequence[Optional[str]]) -> DivergenceError:
    shown = "\n".join(f"  rank {rank}: calls {step}" for rank, step in zip(ranks, steps))
    return DivergenceError(
        "the ranks make different calls at the same time:\n" + shown + "\n"
        "  each compiled step (and spmd.check_replicas) is one program run by every rank of the mesh together: "
        "its collectives meet the peers' same collectives. A call made on some ranks only (an evaluation step "
        "under `if rank == 0:`, one more batch on ranks whose data loader is longer) would exchange data with the "
        "others' next call. Nothing ran, nothing was updated\n"
        "  fix: make every call on every rank, in the same order: evaluate on all ranks, each on its share of the "
        "validation batch (print or save on rank 0 only); give every rank the same number of batches "
        "(DistributedSampler pads to equal lengths; DataLoader(drop_last=True))"
    )


def _one_sided_distribution(
    ranks: Sequence[int], doing: Sequence[Optional[str]], steps: Sequence[Optional[str]]
) -> DivergenceError:
    shown = "\n".join(
        f"  rank {rank}: {what or f'calls {step}'}" for rank, what, step in zip(ranks, doing, steps)
    )
    return DivergenceError(
        "some ranks send loaded state from rank 0 to every rank (a collective) while the others do not:\n" + shown
        + "\n  after spmd.compile's first call (or spmd.parallelize) the parameters and optimizer states are "
        "DTensors: model.load_state_dict of plain tensors, and the next step after optimizer.load_state_dict of "
        "plain states, distribute rank 0's values to every rank, so every rank must make that call; made under "
        "`if rank == 0:` it would wait for the others until the process group's timeout. Nothing was loaded, "
        "the step did not run\n"
        "  fix: load on every rank (each rank may read the checkpoint file; rank 0's values are the ones used), "
        "or load a sharded checkpoint with torch.distributed.checkpoint on every rank"
    )


_VALUE_SAMPLE = 1 << 16


def replicated_values(leaves: Sequence[torch.Tensor], plan: ResolvedPlan, mesh: DeviceMesh) -> list[tuple[int, tuple[int, ...], int]]:
    """``(argument index, mesh dims that split it, CRC-32 of its values)`` for each batch tensor some
    mesh dim of size > 1 replicates (a tensor-parallel dim): the ranks that hold the same piece of it
    must hold the same values. Tensors of more than 65,536 elements are sampled at evenly spaced
    elements (a different batch differs there too). Not 0-d tensors: :func:`check_batch` compares
    their values on every call."""
    out = []
    for i, t in enumerate(leaves):
        if t.dim() == 0:
            continue
        placements = plan.batch_placements(t)
        if not any(isinstance(p, Replicate) and mesh.size(d) > 1 for d, p in enumerate(placements)):
            continue
        crc = _crc(t)
        out.append((i, tuple(d for d, p in enumerate(placements) if isinstance(p, Shard)), crc))
    return out


def replica_disagreement(ranks: Sequence[int], held: Sequence[tuple[Any, Any]]) -> Optional[str]:
    """``held``: for each of ``ranks``, (the piece of a tensor it holds, a digest of its values). Ranks
    that hold the same piece must hold the same values: for the first piece whose holders disagree,
    the ranks on each side (``"rank 0 | rank 1"``, ``"ranks 0, 2 | rank 1"``); None when all agree."""
    by_piece: dict[Any, dict[Any, list[int]]] = {}
    for rank, (piece, value) in zip(ranks, held):
        by_piece.setdefault(piece, {}).setdefault(value, []).append(rank)
    for by_value in by_piece.values():
        if len(by_value) > 1:
            return " | ".join(("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs)) for rs in by_value.values())
    return None


def _check_replicated_values(leaves: Sequence[torch.Tensor], plan: ResolvedPlan, mesh: DeviceMesh, group) -> None:
    """Raise :class:`BatchError` on every rank when ranks that replicate a batch tensor (the same
    coordinates on the mesh dims that split it) pass different values (:func:`replicated_values`)."""
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, replicated_values(leaves, plan, mesh), group=group)
    ranks = dist.get_process_group_ranks(group)
    # Each rank's coordinates on the mesh, from one pass over it (not one scan of the mesh per rank).
    shape = tuple(mesh.mesh.shape)
    position = {r: i for i, r in enumerate(mesh.mesh.flatten().tolist())}
    coords = {r: [position[r] // math.prod(shape[d + 1:]) % shape[d] for d in range(len(shape))] for r in ranks}
    lines = []
    for k, (i, split, _) in enumerate(reports[0]):
        sides = replica_disagreement(
            ranks, [(tuple(coords[rank][d] for d in split), report[k][2]) for rank, report in zip(ranks, reports)]
        )
        if sides is not None:
            lines.append(_replica_line(leaves[i], i, [d for d in range(mesh.ndim) if d not in split and mesh.size(d) > 1], sides))
    if lines:
        raise _replicas_differ(lines)


def _different_scalars(leaves: Sequence[torch.Tensor], mesh: DeviceMesh, ranks: Sequence[int], scalars: Sequence[tuple]) -> BatchError:
    """The error for ranks that pass 0-d tensor arguments of different values (``scalars``: each
    rank's ``(argument index, value)`` pairs)."""
    lines = []
    for k, (i, _) in enumerate(scalars[0]):
        sides = replica_disagreement(ranks, [((), repr(s[k][1])) for s in scalars])
        if sides is not None:
            values = ", ".join(f"rank {rank} {s[k][1]!r}" for rank, s in zip(ranks, scalars))
            lines.append(_replica_line(leaves[i], i, [d for d in range(mesh.ndim) if mesh.size(d) > 1], f"{sides} ({values})"))
    return _replicas_differ(lines)


def _different_tensor_constants(ranks: Sequence[int], held: Sequence[tuple]) -> BatchError:
    """The error for ranks whose tensors read from elsewhere (``held``: each rank's ``(label, digest)``
    pairs, :attr:`CallState.tensor_constants`) hold different values."""
    lines = []
    for k, (label, _) in enumerate(held[0]):
        sides = replica_disagreement(ranks, [((), h[k] if k < len(h) else None) for h in held])
        if sides is not None:
            lines.append(f"  {label}: values differ between {sides}")
    return BatchError(
        "the ranks hold different values of tensors the step reads that are not its arguments, the model's "
        "or the optimizer's:\n" + "\n".join(lines) + "\n"
        "  such a tensor is a replicated input of the one program over the global batch (its value on one "
        "device), the same on every rank; the step did not run, nothing was updated\n"
        "  fix: give it the same values on every rank: seed before creating it (a module built at import time "
        "is initialized from each process's own random state), compute it from data every rank has (class "
        "weights from the whole dataset's labels, not from a rank's shard), or register it on the model "
        "(`model.register_buffer(name, tensor)`), whose state every rank receives from rank 0 on the first call"
    )


def value_digest(t: torch.Tensor) -> int:
    """CRC-32 of ``t``'s values (sampled at 65,536 evenly spaced elements above that), computed again
    only when ``t`` was written in place since (its version counter; writes through ``.data`` or a
    numpy view are not counted)."""
    cached = _DIGESTS.get(t)
    if cached is not None and cached[0] == t._version:
        return cached[1]
    crc = _crc(t)
    _DIGESTS[t] = (t._version, crc)
    return crc


def _crc(t: torch.Tensor) -> int:
    flat = t.detach().reshape(-1)
    if flat.numel() > _VALUE_SAMPLE:
        flat = flat[:: -(-flat.numel() // _VALUE_SAMPLE)]
    return zlib.crc32(flat.contiguous().view(torch.uint8).cpu().numpy())


_DIGESTS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _replica_line(t: torch.Tensor, index: int, dims: list[int], sides: str) -> str:
    """One line of :func:`_replicas_differ`: batch argument ``index``, the mesh ``dims`` replicating it,
    the ranks on each side."""
    return (
        f"  argument {index} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}, replicated over mesh "
        f"dim(s) {dims}: values differ between {sides}"
    )


def _replicas_differ(lines: list[str]) -> BatchError:
    """The error for replicated batch tensors whose values differ between ranks (``lines``: one each)."""
    return BatchError(
        "ranks that hold the same replicated batch tensor pass different values:\n" + "\n".join(lines) + "\n"
        "  a replicated tensor is one value of the program, the same on those ranks: tensor-parallel ranks "
        "compute their parts of one step over the same batch (with different batches each rank's columns "
        "come from other samples and the row-parallel all-reduce adds them up); a 0-d tensor argument is "
        "one value on every rank\n"
        "  fix: split the data over the data-parallel ranks only and give every rank of a tensor-parallel "
        "group the same batch (DistributedSampler(dataset, num_replicas=mesh['dp'].size(), "
        "rank=mesh['dp'].get_local_rank()) on a ('dp', 'tp') mesh, the same batch on every rank of a "
        "tensor-parallel-only mesh); compute a rank-dependent scalar (a count of this rank's tokens) "
        "inside the step, from the global batch"
    )


def _different_values(hyperparameters: Sequence[Any], ranks: Sequence[int], values: Sequence[tuple]) -> SpmdError:
    """The error for ranks whose graph's float inputs ``values`` (one tuple per rank) differ: the
    optimizer's hyperparameters (``DivergenceError``) or the step's float arguments (``BatchError``)."""
    if len({len(v) for v in values}) == 1:
        differ = [i for i in range(len(values[0])) if len({repr(v[i]) for v in values}) > 1]
        shown = "\n".join(
            f"  {hyperparameters[i]}: " + ", ".join(f"rank {rank} {v[i]!r}" for rank, v in zip(ranks, values))
            for i in differ
        )
        if differ and all(isinstance(hyperparameters[i], (FloatArgument, FloatConstant)) for i in differ) and any(
            isinstance(hyperparameters[i], FloatConstant) for i in differ
        ):
            return DivergenceError(
                "the ranks hold different values of Python floats the step reads (graph inputs):\n" + shown + "\n"
                "  a compiled step is one program over the global batch, and a float it reads is one of its values, "
                "the same on every rank; the step did not run, nothing was updated\n"
                "  fix: set it the same way on every rank (not under `if rank == 0:`, not from the rank or from a "
                "rank's own batch: a value computed from the batch is computed inside the step, where the batch is "
                "the global one)"
            )
        if all(isinstance(hyperparameters[i], FloatArgument) for i in differ):
            return BatchError(
                "the ranks pass different float arguments to the step:\n" + shown + "\n"
                "  a compiled step is one program over the global batch, and a Python argument is one of its "
                "values, the same on every rank; the step did not run, nothing was updated\n"
                "  fix: pass every rank the same value (draw a random one from a generator seeded the same on "
                "every rank, or broadcast it from rank 0); a value computed from a rank's own batch is computed "
                "inside the step instead, where the batch is the global one"
            )
    else:
        shown = "\n".join(f"  rank {rank}: {len(v)} hyperparameters {v}" for rank, v in zip(ranks, values))
    return DivergenceError(
        "the ranks' optimizers have different hyperparameters:\n" + shown + "\n"
        "  every rank updates its part of the same parameters, so every rank must use the same values "
        "(one device has one optimizer); the step did not run, nothing was updated\n"
        "  fix: change hyperparameters on every rank, not under `if rank == 0:` (step the LR scheduler on "
        "every rank), and feed ReduceLROnPlateau a metric the ranks agree on (all-reduce the validation "
        "loss before `scheduler.step(loss)`)"
    )


def state_summary(model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> dict[str, str]:
    """What selects a compiled graph for a model and optimizer, by name: every module's ``training``
    flag, every parameter's ``requires_grad``, the hooks of each module and parameter (counts), each
    param group's non-float settings. Rank-independent (no addresses); for error messages."""
    out: dict[str, str] = {}
    if model is not None:
        for name, m in model.named_modules():
            label = f"model.{name}" if name else "model"
            out[f"{label}.training"] = repr(m.training)
            counts = tuple(map(len, MODULE_HOOKS(m)))
            if any(counts):
                out[f"{label} hooks (forward-pre, forward, backward-pre, backward)"] = repr(counts)
        for name, p in model.named_parameters():
            out[f"model.{name}.requires_grad"] = repr(p.requires_grad)
            counts = tuple(map(len, filter(None, TENSOR_HOOKS(p))))
            if any(counts):
                out[f"model.{name} gradient hooks"] = repr(counts)
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            out[f"param_groups[{i}] size"] = repr(len(group["params"]))
            for key, value in group.items():
                if key != "params":
                    out[f"param_groups[{i}][{key!r}]"] = repr(_setting_kind(value))
    return out


def _different_graphs(ranks: Sequence[int], graphs: Sequence[Optional[int]], summaries: Sequence[Optional[dict]]) -> DivergenceError:
    """The error for ranks about to run different compiled graphs (``graphs``: each rank's digest, None
    for a new compilation), naming the model and optimizer settings (:func:`state_summary`) that differ."""
    names: dict[Optional[int], str] = {}
    for g in graphs:
        if g is not None and g not in names:
            names[g] = f"graph {len(names) + 1} (compiled earlier)"
    doing = "\n".join(
        f"  rank {rank}: " + (names[g] if g is not None else "compiles a new graph (its state matches no compiled one)")
        for rank, g in zip(ranks, graphs)
    )
    summaries = [s or {} for s in summaries]
    keys = [k for k in summaries[0] if any(s.get(k) != summaries[0][k] for s in summaries)]
    keys += sorted({k for s in summaries for k in s} - set(summaries[0]))
    per_rank = {k: ", ".join(f"rank {rank} {s.get(k, 'absent')}" for rank, s in zip(ranks, summaries)) for k in keys}

    def parent(key: str) -> str:  # model.a.b.training -> model.a.training
        return key.rsplit(".", 2)[0] + ".training" if key.count(".") > 1 else ""

    # A mode set on a module and all its children (model.eval()) is one line: the module's.
    folded = [k for k in keys if not (k.endswith(".training") and per_rank.get(parent(k)) == per_rank[k])]
    shown = "\n".join(
        f"  {k}: {per_rank[k]}" + (" (and its submodules)" if any(parent(j) == k for j in set(keys) - set(folded)) else "")
        for k in folded[:8]
    ) + (f"\n  ... and {len(folded) - 8} more" if len(folded) > 8 else "")
    return DivergenceError(
        "the ranks would run different compiled graphs of the step:\n" + doing + "\n"
        + ("  they differ in:\n" + shown + "\n" if folded else
           "  the modules' train/eval modes, requires_grad, hooks and param-group settings agree: the difference "
           "is in another value the graph depends on (a Python value the step reads, a global or closure "
           "variable, torch's global state such as autocast)\n")
        + "  an SPMD program is one program on every rank; the step did not run, nothing was updated\n"
        "  fix: change the model and optimizer the same way on every rank (call model.train() / model.eval() "
        "on every rank, not under `if rank == 0:`; evaluate on every rank, or restore the mode after a "
        "rank-0-only evaluation)"
    )


class _StateReady(Exception):
    """Raised by the wrapped ``_init_group`` to stop ``optimizer.step()`` before any update."""


def initialize_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, attempted: set) -> bool:
    """Create the optimizer's lazily created state (Adam's ``exp_avg``, ``step``, ...) before tracing.

    torch's optimizers create state in ``_init_group`` on the first ``step()``; creating it up front
    (as torch's compiled optimizer does) lets the first call trace the steady-state graph, so a training
    loop compiles once. Runs ``optimizer.step()`` with zero gradients for the trainable parameters that
    have no state, stopped right after ``_init_group`` of each param group, so no parameter, gradient
    or step count changes. Optimizers without ``_init_group``, and optimizers whose first step differs
    from later ones (SGD creates its momentum buffer from the first gradient), keep their lazy state:
    their second call compiles the steady-state graph.

    An optimizer that wraps another (timm's ``Lookahead``, accelerate's ``AcceleratedOptimizer``) has its
    base optimizer's state created so (:mod:`spmd_expand.optimizer_state`).

    Returns whether any state was created. ``attempted`` (ids of (optimizer, parameter) pairs already
    tried) is updated.
    """
    created = False
    for _, holder in optimizer_state.holders(optimizer, every=True):
        created = _initialize_state(holder, attempted) or created
    return created


def _initialize_state(optimizer: torch.optim.Optimizer, attempted: set) -> bool:
    init_group = getattr(type(optimizer), "_init_group", None)
    if init_group is None:
        return False
    created = False
    for group in optimizer.param_groups:
        todo = [
            p for p in group["params"]
            if p.requires_grad and not optimizer.state.get(p) and (id(optimizer), id(p)) not in attempted
        ]
        if not todo:
            continue
        attempted.update((id(optimizer), id(p)) for p in todo)
        saved_groups = optimizer.param_groups
        saved_grads = [p.grad for p in todo]

        def init_then_stop(self, *args, **kwargs):
            init_group(self, *args, **kwargs)
            raise _StateReady

        optimizer._init_group = init_then_stop.__get__(optimizer)
        try:
            with torch.no_grad():
                for p in todo:
                    p.grad = torch.zeros_like(p)
            optimizer.param_groups = [{**group, "params": todo}]
            try:
                optimizer.step()
            except _StateReady:
                pass
        finally:
            del optimizer._init_group
            optimizer.param_groups = saved_groups
            for p, g in zip(todo, saved_grads):
                p.grad = g
        created = created or any(optimizer.state.get(p) for p in todo)
    return created
