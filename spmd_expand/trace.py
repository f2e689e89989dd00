"""Trace a whole train step (forward, backward, optimizer) into one functional global graph.

The step is traced with ``make_fx`` on fake tensors that have the *global* shapes, then made functional:

1. graph 1, traced with autograd, so ``loss.backward()`` records the backward ops and
   ``optimizer.step()`` records the update (in-place ops included). Shapes are global and static (a
   new shape is a new cache entry): a size the step reads from its batch is the global size, a
   constant of the graph (propagation's DSymInt handles ``sym_size`` nodes where a graph has them);
2. mutation removed: updated parameters, buffers, optimizer states and gradients become
   ``aten.copy_`` into their placeholders at the end of the graph (what AOTAutograd does for input
   mutations). Where every write is to a whole tensor (the common case: optimizer updates, gradient
   accumulation, ``relu_``), :func:`spmd_expand.functionalize.functionalize_graph` does it in one walk
   over graph 1; otherwise (writes through views) graph 1 is traced again through
   ``torch.func.functionalize`` over an fx Interpreter (:func:`_functionalize_by_tracing`). Both
   apply the same decompositions and rewrites (:func:`_decompositions`).

The graph's placeholders follow :attr:`TracedStep.inputs` (tensors), then
:attr:`TracedStep.hyperparameters` (Python floats: learning rates, betas, weight decay, ... of the
optimizer's param groups, then the step's float arguments, traced as ``SymFloat`` so that a new value
needs no new graph); its outputs
follow :attr:`TracedStep.outputs`.

Inside the step the module's parameters are the traced leaves themselves (the same objects the
optimizer updates and whose ``.grad`` autograd fills). A ``TorchFunctionMode`` marks, without changing
values, where the step *reads* them: a parameter read by the model goes through
``spmd_expand::unshard`` (:func:`spmd_expand.ops.unshard`), a gradient read after ``backward()`` (by the
optimizer, ``clip_grad_norm_``, the user's code) through ``spmd_expand::gradient``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import sympy

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch._dynamo.source import ConstantSource
from torch.nn.utils import stateless
from torch.overrides import TorchFunctionMode
from torch.utils._sympy.printers import PythonPrinter
from torch.utils._sympy.symbol import SymT, symbol_is_type

from . import ops, optimizer_state
from .boundaries import mark_boundaries, mark_sequence_first
from .python_values import (
    CodeIdentity,
    GlobalState,
    HeldModules,
    PythonGuards,
    PythonValue,
    RandomStateUse,
    StateChange,
    StateWatch,
    TensorConstant,
    code_prints,
    code_reads,
    float_places,
    called_methods,
    class_attribute_reads,
    code_writes,
    forward_functions,
    hook_functions,
    record_reads,
    settings_variables,
    tensor_constants,
    user_optimizers,
)
from .errors import SpmdError, TraceError, in_torch_or_spmd_expand, node_error, user_source_line
from .forms import encoder_nested_fast_path, equal_forms_patched, equal_valued_form
from .functionalize import functionalize_graph, list_functional_twin, written_values
from .loss_parallel import MarkLossParallel
from .plans import MixedPrecision, ParamCast
from .stack_traces import BACKWARD_CALLS as _BACKWARD_CALLS, RecordStackTraces

__all__ = [
    "FloatArgument",
    "FloatConstant",
    "HyperParameter",
    "HyperParameterGuards",
    "InputRole",
    "OutputRole",
    "TracedStep",
    "TensorSpec",
    "argument_labels",
    "float_arguments",
    "hyperparameters_of",
    "is_runtime_scalar",
    "step_float_constants",
    "trace_step",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class InputRole:
    """What a graph placeholder is: ``kind`` in {param, buffer, grad, state, batch, constant}.

    ``fqn`` names the parameter or buffer (for grad/state: the parameter); ``key`` is the optimizer
    state key (``"exp_avg"``), for batch tensors the index of the leaf among the step's tensor args,
    for a constant (a tensor the step reads from elsewhere, :class:`~spmd_expand.python_values.TensorConstant`)
    the label of its place.
    """

    kind: str
    fqn: str = ""
    key: str = ""


@dataclass(frozen=True)
class OutputRole:
    """What a graph output is: ``kind`` in {return, state, grad}; fields as in :class:`InputRole`."""

    kind: str
    fqn: str = ""
    key: str = ""


@dataclass(frozen=True)
class TensorSpec:
    """Global metadata of one step input: shape, dtype, device, and which dims are symbolic."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    dynamic_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class HyperParameter:
    """A float setting of an optimizer param group (``lr``, ``betas[0]``, ``weight_decay``, ...).

    It is a graph input: LR schedulers and user code may change it between calls without a new
    trace. ``index`` is the position inside a tuple setting (``betas``), else None.
    """

    group: int
    key: str
    index: Optional[int] = None

    def read(self, optimizer: torch.optim.Optimizer, leaves: Sequence[Any] = ()) -> float:
        value = optimizer.param_groups[self.group][self.key]
        if self.index is not None:
            value = value[self.index]
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def __str__(self) -> str:
        return f"param_groups[{self.group}][{self.key!r}]" + (f"[{self.index}]" if self.index is not None else "")

    @property
    def name(self) -> str:
        """A dotted name for graph dumps: ``0.lr``, ``0.betas.1``."""
        return f"{self.group}.{self.key}" + (f".{self.index}" if self.index is not None else "")


@dataclass(frozen=True)
class FloatArgument:
    """A Python float among the step's arguments: a mixup ``lam`` drawn every step, a KL weight or an
    EMA decay a schedule changes, a gradient-reversal coefficient.

    Like the optimizer's float settings it is a graph input (traced as a ``SymFloat``), so a new value
    needs no new graph; what the trace assumed about it (``if lam > 0.5:``) is a hyperparameter guard.
    ``position`` is its index among the leaves of ``pytree.tree_flatten((args, kwargs))``; ``label``
    names it for messages and dumps (``lam``, ``cfg['beta']``).
    """

    position: int
    label: str

    def read(self, optimizer: Optional[torch.optim.Optimizer], leaves: Sequence[Any]) -> float:
        return float(leaves[self.position])

    def __str__(self) -> str:
        return f"argument {self.label}"

    @property
    def name(self) -> str:
        """A name for graph dumps: ``arg.lam``."""
        return f"arg.{self.label}"


@dataclass(frozen=True)
class FloatConstant:
    """A Python float the step's code reads from a global, a closure variable, a user module's
    attribute (``loss * KL_WEIGHT``, ``F.leaky_relu(x, SLOPE)``, ``config.TEMPERATURE``), or an
    attribute of a settings object or of one of the model's modules of the user's own classes
    (``args.kl_weight``, ``self.temperature``): a weight a curriculum or an annealing schedule changes
    between calls.

    Like a float argument it is a graph input, traced as a ``SymFloat`` that stands in its place
    (:func:`_floats_in_place`), so a new value needs no new graph; what the trace assumed about it is
    a hyperparameter guard. Found by :func:`step_float_constants`; ``label`` names the place
    (``global KL_WEIGHT of train``); ``place`` reads it (a ``python_values`` slot: call it; its
    ``write`` puts a value there). A place that no longer holds a float takes the full path.
    """

    label: str
    place: Callable[[], Any] = field(compare=False)

    def read(self, optimizer: Optional[torch.optim.Optimizer], leaves: Sequence[Any]) -> float:
        value = self.place()
        if type(value) is not float:
            raise LookupError(f"{self.label} holds {type(value).__name__}, not a float")
        return value

    def __str__(self) -> str:
        return self.label

    @property
    def name(self) -> str:
        """A name for graph dumps: ``float.global_KL_WEIGHT_of_train``."""
        return "float." + re.sub(r"\W+", "_", self.label)


def argument_labels(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[str]:
    """A name for each leaf of ``pytree.tree_flatten((args, kwargs))``, for messages: the parameter of
    ``fn`` it is passed as, with the path inside a list, tuple or dict (``lam``, ``cfg['beta']``,
    ``args[5]`` for one of ``*args``)."""
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    try:
        names = [
            name for name, p in inspect.signature(fn).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a callable without a signature
        names = []
    labels = []
    for path, _leaf in flat:
        key = path[1]
        if path[0].idx == 1:  # a keyword argument
            top = str(key.key)
        else:
            top = names[key.idx] if key.idx < len(names) else f"args[{key.idx}]"
        labels.append(top + pytree.keystr(path[2:]))
    return labels


def float_arguments(leaves: Sequence[Any], labels: Sequence[str]) -> list[FloatArgument]:
    """The Python floats among ``leaves`` (of ``pytree.tree_flatten((args, kwargs))``: also inside
    lists, tuples and dicts; not bools, ints or attributes of objects), named by ``labels``
    (:func:`argument_labels`)."""
    return [FloatArgument(i, labels[i]) for i, leaf in enumerate(leaves) if isinstance(leaf, float)]


def _is_float_setting(value: Any) -> bool:
    if isinstance(value, torch.Tensor):  # a tensor lr (torch's compiled-optimizer idiom)
        return value.numel() == 1 and value.dtype.is_floating_point and not value.requires_grad
    return isinstance(value, float)


def hyperparameters_of(optimizer: Optional[torch.optim.Optimizer]) -> list[HyperParameter]:
    """Every float setting of every param group, in a fixed order (the graph's input order).

    Ints, bools, strings and None (``foreach``, ``nesterov``, ``amsgrad``, ...) choose code paths and
    are part of the compiled step's cache key instead.
    """
    found: list[HyperParameter] = []
    for g, group in enumerate(optimizer.param_groups if optimizer is not None else ()):
        for key, value in group.items():
            if key == "params":
                continue
            if _is_float_setting(value):
                found.append(HyperParameter(g, key))
            elif isinstance(value, tuple) and value and all(_is_float_setting(v) for v in value):
                found.extend(HyperParameter(g, key, i) for i in range(len(value)))
    return found


def is_runtime_scalar(value: Any) -> bool:
    """Whether ``value`` (a node's ``meta["val"]``) is a float computed from hyperparameter inputs."""
    return isinstance(value, torch.SymFloat) and any(
        symbol_is_type(s, SymT.FLOAT) for s in value.node.expr.free_symbols
    )


@dataclass
class HyperParameterGuards:
    """What the traced graph assumed about hyperparameter values (e.g. ``weight_decay != 0`` chose a
    code path, or a fused kernel took ``lr`` as a constant): sympy conditions over the hyperparameter
    symbols, checked on every call (:meth:`check`)."""

    symbols: list[sympy.Symbol]
    conditions: list[sympy.Expr]
    sources: list[str]
    # The traced value and name of each hyperparameter: a symbol is a finite real, so what the trace
    # assumed about an infinite or NaN value (`float(max_norm)` with max_norm=inf) is a guard that
    # sympy folds to False and drops. A graph traced with such a value is only for that value, and a
    # graph traced with finite values only for finite ones.
    hints: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    _compiled: Optional[Callable[..., list]] = field(default=None, init=False, repr=False, compare=False)

    def check(self, values: Sequence[float]) -> Optional[str]:
        """None when every condition holds for ``values`` (one per hyperparameter), else the first
        failing condition, written with the hyperparameter names."""
        for hint, value, name in zip(self.hints, values, self.names):
            if not (math.isfinite(hint) and math.isfinite(value)) and repr(float(hint)) != repr(float(value)):
                return f"{name} == {hint!r}"
        if not self.conditions:
            return None
        if self._compiled is None:
            # Once per compilation: the conditions as Python code over floats (sympy evaluation per
            # call cost ~1 ms for a few conditions; this costs microseconds), printed as Dynamo prints
            # its guards: torch's own sympy functions (FloatTrueDiv, TruncToInt, PythonMod, ...) as
            # Python operators and math calls, which sympy.lambdify does not know.
            printer = PythonPrinter()
            body = ", ".join(f"({printer.doprint(c)})" for c in self.conditions)
            self._compiled = eval(f"lambda {', '.join(map(str, self.symbols))}: [{body}]", {"math": math})  # noqa: S307
        for holds, source in zip(self._compiled(*map(float, values)), self.sources):
            if not bool(holds):
                return source
        return None


@dataclass
class TracedStep:
    """The global (single-device) graph of a train step and the meaning of its inputs and outputs."""

    graph_module: fx.GraphModule
    inputs: list[InputRole]
    outputs: list[OutputRole]
    input_specs: list[TensorSpec]
    return_spec: pytree.TreeSpec
    return_is_tensor: list[bool]
    # Parameters whose gradient was an input and is None after the step (zero_grad()).
    cleared_grads: list[str]
    fake_mode: FakeTensorMode = field(repr=False)
    hyperparameters: list = field(default_factory=list)  # HyperParameter, then FloatArgument, then FloatConstant
    guards: HyperParameterGuards = field(default_factory=lambda: HyperParameterGuards([], [], []))
    # Python values the trace read and baked in (module attributes, globals, closure variables).
    python_guards: PythonGuards = field(default_factory=PythonGuards)
    # Non-tensor optimizer states the step set, (fqn, key, value): stored after every run of the graph,
    # which only runs on the values it was traced from (they are part of its cache key).
    state_writes: list[tuple[str, str, Any]] = field(default_factory=list)
    # Int/bool param-group settings the step set, (group index, key, value): stored back the same way.
    group_writes: list[tuple[int, str, Any]] = field(default_factory=list)
    # Submodules whose train()/eval() mode the step set, (fqn, training): set again after every run of
    # the graph (the mode before the call is part of its cache key, so the mode after is fixed).
    mode_writes: list[tuple[str, bool]] = field(default_factory=list)
    # Python scalars the step assigned to attributes and variables (StateChange.replay): assigned again
    # after every run of the graph, which runs only on the values it read when it was traced.
    python_writes: list[Callable[[Sequence[float]], None]] = field(default_factory=list)

    @functools.cached_property
    def first_backward_node(self) -> Optional[fx.Node]:
        """The first node a ``backward()`` / ``torch.autograd.grad`` call of the step made (None: the
        step computes no gradients, e.g. an evaluation step)."""
        return next((n for n in self.graph_module.graph.nodes if backward_index(n) is not None), None)

    @functools.cached_property
    def mutated_batch_leaves(self) -> frozenset[int]:
        """Positions among the step's tensor arguments (``InputRole.key`` of a batch input) of the
        batch tensors the step writes in place (``x.mul_(2)``): an ``aten.copy_`` into their placeholder."""
        placeholders = {node: i for i, node in enumerate(self.graph_module.graph.find_nodes(op="placeholder"))}
        written = {
            placeholders[node.args[0]]
            for node in self.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
            if node.args[0] in placeholders
        }
        return frozenset(
            int(role.key) for i, role in enumerate(self.inputs) if i in written and role.kind == "batch"
        )


def _nll_loss_mean_as_sum(forward: torch._ops.OpOverload) -> Callable:
    """``forward`` (``nll_loss_forward``, or ``nll_loss2d_forward`` for ``(N, C, H, W)`` inputs) with
    ``reduction="mean"`` as ``sum / total_weight`` (same values).

    DTensor's rule for the mean form averages per-rank means (``Partial(avg)``), which is wrong when
    ranks ignore different numbers of targets; as a sum and a total weight, both are reduced before
    the division, so the mean is over the global batch.

    Without class weights the total weight is the number of targets not equal to ``ignore_index``
    (what ``nll_loss_forward`` returns), counted here from ``target`` alone: the count then depends
    on no activation, so under data parallelism its all-reduce can be issued when the step starts
    (the ``overlap`` pass moves it there) instead of blocking after the forward.
    """

    def mean_as_sum(self, target, weight, reduction, ignore_index):
        if reduction != 1:  # torch._reduction: 0 none, 1 mean, 2 sum
            return NotImplemented
        total, total_weight = forward(self, target, weight, 2, ignore_index)
        if weight is None:
            counted = aten.sum.default(aten.ne.Scalar(target, ignore_index))
            total_weight = aten._to_copy.default(counted, dtype=self.dtype)
        return total / total_weight, total_weight

    return mean_as_sum


# Applied while removing mutation (step 2 above): rewrites that keep single-device values and give the
# sharded program the global semantics.
_REWRITES = {op: _nll_loss_mean_as_sum(op) for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)}
# Ops with a decomposition but no DTensor strategy that stay as they are: host reads and constants
# (refused or placed by spmd_expand's own rules).
_KEEP = frozenset({aten.item.default, aten.sym_numel.default, aten.lift.default, aten.lift_fresh.default})


@functools.cache
def _decompositions() -> dict:
    """The rewrites above, plus torch's decomposition of every op DTensor has no strategy for.

    DTensor (torch 2.13, ``DecompShardingStrategy``) places such an op by tracing its decomposition,
    but the op then runs as is on the local shards, where a constant the decomposition takes from the
    *global* shape comes out of the *local* one: ``mse_loss_backward`` with ``reduction="mean"``
    divides by the local element count, so data-parallel gradients came out W times too large
    (``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy`` alike). Decomposed here, while the
    graph still has global (symbolic) shapes, every size is global and every op left has a strategy.
    """
    from torch._decomp import decomposition_table
    from torch.distributed.tensor import DTensor

    from . import rules

    prop = DTensor._op_dispatcher.sharding_propagator
    placed = set(prop.op_strategy_funcs) | set(prop.op_to_rules) | set(prop.op_single_dim_strategy_funcs)
    table = {
        op: fn
        for op, fn in decomposition_table.items()
        if isinstance(op, torch._ops.OpOverload)
        and op not in placed
        and op not in _KEEP
        and rules.lookup(op) is None
        and not op.name().endswith("_")  # in-place: functionalization has removed them
        # torch._refs decompositions produce prims ops, which DTensor cannot place either.
        and not getattr(fn, "__module__", "").startswith("torch._refs")
    }
    return {**table, **_REWRITES}


class _FunctionalizingInterpreter(fx.Interpreter):
    """Runs graph 1 under functionalize, swapping fused in-place optimizer ops for functional ones:
    torch 2.13's C++ functionalization kernels of ``aten._fused_adamw_`` and its kind cannot handle
    their list arguments, so the functional variant (:func:`~spmd_expand.functionalize.list_functional_twin`)
    returns the updated lists, which are copied back."""

    def call_function(self, target, args, kwargs):
        functional = list_functional_twin(target) if isinstance(target, torch._ops.OpOverload) else None
        if functional is not None:
            results = functional(*args, **kwargs)
            for written, new_values in zip(written_values(target, args, kwargs), results):
                for dst, src in zip(written, new_values):
                    dst.copy_(src)
            return None
        return super().call_function(target, args, kwargs)


def _functionalize_by_tracing(autograd_graph: fx.GraphModule, fakes: list, sym_values: list) -> fx.GraphModule:
    """Pass 2 as a trace: graph 1 run again under ``torch.func.functionalize`` and ``make_fx``, which
    also removes writes through views (view replay) that :func:`functionalize_graph` leaves to it."""
    detached = [t.detach() for t in fakes]

    def replay(*flat: Any) -> list[torch.Tensor]:
        with torch.no_grad(), fx_traceback.preserve_node_meta():
            return _FunctionalizingInterpreter(autograd_graph).run(*flat)

    return make_fx(
        torch.func.functionalize(replay, remove="mutations"),
        decomposition_table=_decompositions(),
        tracing_mode="symbolic",
    )(*detached, *sym_values)


def _is_profiler_node(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "profiler"


BACKWARD_KEY = "spmd_backward"


def backward_index(node: fx.Node) -> Optional[int]:
    """1-based index of the ``backward()`` call that created ``node``; None outside backward."""
    return (node.meta.get("custom") or {}).get(BACKWARD_KEY)


# Marks the copy_ node that stands for ``tensor.data = value`` (see _assign_data).
DATA_ASSIGNMENT_KEY = "spmd_data_assignment"
_GRAD = torch._C.TensorBase.__dict__["grad"]
_DATA = torch._C.TensorBase.__dict__["data"]
# Reads of a parameter that look at metadata only: no unshard marker for these.
_METADATA_READS = frozenset(
    {"__get__", "__set__", "size", "dim", "numel", "stride", "nelement", "element_size", "is_contiguous",
     "storage_offset", "data_ptr", "get_device", "is_floating_point", "is_complex", "type", "__len__",
     "__repr__", "__format__", "__deepcopy__", "__reduce_ex__", "__setstate__", "untyped_storage"}
)


# The same reads as ATen ops: a tensor subclass answers C++ metadata queries through them (autograd
# asks a parameter handed straight to a custom ``autograd.Function`` for its device while it holds the
# parameter's lock: marking that read would take the lock again, a deadlock).
_METADATA_OPS = frozenset(
    {
        torch.ops.prim.device.default, torch.ops.prim.layout.default, torch.ops.prim.dtype.default,
        aten.dim.default, aten.sym_size.default, aten.sym_size.int, aten.sym_stride.default, aten.sym_stride.int,
        aten.sym_numel.default, aten.sym_storage_offset.default, aten.is_contiguous.default,
        aten.is_contiguous.memory_format, aten.is_strides_like_format.default,
        aten.is_non_overlapping_and_dense.default,
    }
)


# ``self + value * t1 (/ or *) t2`` ops given their ``value`` as a tensor, which the optimizers'
# traceable default path does (Adam's ``step_size`` under ``torch.compiler.is_compiling()``). Traced
# as is, a fake tensor's data would be read as the Python number (single-tensor ``addcdiv_``), or the
# fake kernel rejects it (foreach: "Expected scalars to be on CPU, got meta"). They are decomposed in
# the eager CPU kernel's order, ``self + ((value * t1) op t2)``, which rounds the same.
_POINTWISE_WITH_VALUE = {
    torch._foreach_addcdiv_: torch._foreach_div_,
    torch._foreach_addcmul_: torch._foreach_mul_,
    torch.Tensor.addcdiv_: torch.Tensor.div_,
    torch.Tensor.addcmul_: torch.Tensor.mul_,
}


def _decompose_tensor_value(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable[[], Any]]:
    """A thunk computing ``func(*args, **kwargs)`` without a tensor ``value``, or None if not needed."""
    op = _POINTWISE_WITH_VALUE.get(func)
    if op is None:
        return None
    self_, tensor1, tensor2, *rest = args
    value = rest[0] if rest else kwargs.get("value")
    if not isinstance(value, torch.Tensor):
        return None
    if func in (torch._foreach_addcdiv_, torch._foreach_addcmul_):

        def foreach() -> None:
            values = torch._foreach_mul(list(tensor1), list(value.unbind(0)))
            op(values, list(tensor2))
            torch._foreach_add_(self_, values)

        return foreach
    return lambda: self_.add_(op(value * tensor1, tensor2))


def _mutates_first_arg(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"


class _CastForCompute(torch.autograd.Function):
    """A parameter read under mixed precision (FSDP2's ``MixedPrecisionPolicy`` semantics).

    Forward: the parameter cast to ``param_dtype`` (before the ``unshard`` marker, so the cast runs
    on the shard and an FSDP all-gather moves ``param_dtype``). Backward: the gradient cast to
    ``reduce_dtype``, reduced per the plan right there (a ``gradient`` marker: at the end of each
    backward, as FSDP2 and DDP reduce, in ``reduce_dtype``), then cast to the parameter's dtype.
    """

    @staticmethod
    def forward(ctx, param: torch.Tensor, param_dtype: torch.dtype, reduce_dtype: torch.dtype, fqn: str) -> torch.Tensor:
        ctx.dtype, ctx.reduce_dtype, ctx.fqn = param.dtype, reduce_dtype, fqn
        return param.to(param_dtype, copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reduced = ops.gradient(grad.to(ctx.reduce_dtype), ctx.fqn)
        return reduced.to(ctx.dtype), None, None, None


@contextlib.contextmanager
def _cast_root_io(model: nn.Module, policy: Optional[MixedPrecisionPolicy]) -> Iterator[None]:
    """While tracing: the root module's floating-point inputs cast to ``param_dtype``
    (``cast_forward_inputs``) and its floating-point outputs to ``output_dtype``, as FSDP2 does at
    a ``fully_shard`` module's boundary."""
    hooks = []

    def cast(dtype: torch.dtype, tree: Any) -> Any:
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree
        )

    if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
        hooks.append(
            model.register_forward_pre_hook(
                lambda _, args, kwargs: (cast(policy.param_dtype, args), cast(policy.param_dtype, kwargs)),
                with_kwargs=True,
            )
        )
    if policy is not None and policy.output_dtype is not None:
        hooks.append(model.register_forward_hook(lambda _, args, out: cast(policy.output_dtype, out)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


class _OptimizerStep:
    """``optimizer.step`` while a step is traced: runs the optimizer's step with the mode's
    ``in_optimizer`` count raised (:meth:`_StepMode.optimizer_step`)."""

    def __init__(self, mode: "_StepMode", step: Callable) -> None:
        self.mode, self.step = mode, step
        functools.update_wrapper(self, step)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.mode.in_optimizer += 1
        try:
            return self.step(*args, **kwargs)
        finally:
            self.mode.in_optimizer -= 1


class _StepMode(TorchFunctionMode):
    """Marks, while the step is traced, where it reads parameters and gradients, and tags backward.

    * Every node recorded inside a ``backward()`` (or ``autograd.grad``) call gets
      ``node.meta["custom"]["spmd_backward"] = k`` for the k-th call (needs
      ``fx_traceback.preserve_node_meta()``); later stages tell forward from backward uses by it.
    * A parameter passed to a torch function outside backward and outside ``optimizer.step()`` is
      replaced by ``unshard(param)`` (one marker per parameter, reused; in-place ops still write to the
      parameter itself). Autograd's gradient flows through the marker to the leaf. Under mixed
      precision the marker reads ``_CastForCompute(param)`` instead.
    * Reading ``param.grad`` outside backward returns ``gradient(grad)`` and stores it back, so the
      optimizer, ``clip_grad_norm_`` and user code all see the gradient reduced per the plan, reduced
      once however often it is read (until a later backward accumulates into it again).
    * A few calls are recorded as equal-valued forms that every op of has a sharding rule:
      ``addcdiv_``/``addcmul_`` with a tensor ``value`` (:func:`_decompose_tensor_value`), an adaptive
      average pool to size 1, ``embedding_bag`` of fixed-size bags, ``bilinear``, a matrix's
      ``fill_diagonal_``, ``affine_grid`` and ``multilabel_margin_loss``
      (:func:`spmd_expand.forms.equal_valued_form`).
    """

    def __init__(
        self, params: Mapping[int, tuple[str, torch.Tensor]], casts: Mapping[str, ParamCast], model: Optional[nn.Module] = None
    ) -> None:
        super().__init__()
        self.params = params  # id(leaf) -> (fqn, leaf)
        self.casts = casts  # fqn -> ParamCast, for parameters read in another dtype
        self.model = model
        self.backward_calls = 0
        self.in_backward = False
        self.in_optimizer = 0
        self._unshard: dict[tuple[int, bool, int], torch.Tensor] = {}
        self._marked: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) -> (marked grad, its version)

    @contextlib.contextmanager
    def optimizer_step(self, optimizer: Optional[torch.optim.Optimizer]) -> Iterator[None]:
        """While ``optimizer.step()`` runs, the mode knows that its reads are the optimizer's, not the
        model's.

        Wraps the instance's ``step`` rather than registering step hooks: an optimizer that wraps
        another without calling ``Optimizer.__init__`` (timm's ``Lookahead``) has no hooks. A ``step``
        the instance already holds (an LR scheduler's counting wrapper) is wrapped and put back. The
        wrapper is an object, not a function, so the step's read of ``optimizer.step`` is not taken for
        a function the user gave the optimizer (which would be guarded by identity).
        """
        if optimizer is None:
            yield
            return
        held = vars(optimizer).get("step")
        optimizer.step = _OptimizerStep(self, optimizer.step)
        try:
            yield
        finally:
            if held is None:
                del optimizer.step
            else:
                optimizer.step = held

    def mark_read(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Record that ``grad`` (an input gradient) already has the plan's placement."""
        self._marked[id(param)] = (grad, grad._version)

    def _unshard_of(self, fqn: str, param: torch.Tensor) -> torch.Tensor:
        key = (id(param), torch.is_grad_enabled(), param._version)
        marker = self._unshard.get(key)
        if marker is None:
            cast = self.casts.get(fqn)
            read = param if cast is None else _CastForCompute.apply(param, cast.param_dtype, cast.reduce_dtype, fqn)
            marker = self._unshard[key] = ops.unshard(read, fqn)
        return marker

    def _forward_reads(self) -> contextlib.AbstractContextManager:
        """While backward runs: the model's parameters are the values forward read (their ``unshard``
        markers, cast under mixed precision) instead of the leaves.

        Backward reads a parameter's value only where activation checkpointing
        (``torch.utils.checkpoint``) re-runs a forward inside it; this mode is not active then (a
        torch function mode is popped while its own handler, here ``backward()``, runs). The re-run
        must see what forward saw: the same dtype (checkpoint compares the recomputed metadata), and
        the plan's compute placement, so FSDP gathers the parameter again for backward
        (``regather_for_backward``) rather than gathering activations.
        """
        markers = {}
        for (pid, grad_enabled, version), marker in self._unshard.items():
            fqn, leaf = self.params[pid]
            if grad_enabled and leaf._version == version:
                markers[fqn] = marker
        if self.model is None or not markers:
            return contextlib.nullcontext()
        return stateless._reparametrize_module(self.model, markers, tie_weights=True)

    def _read_grad(self, param: torch.Tensor, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if grad is None or self.in_backward:
            return grad
        marked = self._marked.get(id(param))
        if marked is not None and marked[0] is grad and marked[1] == grad._version:
            return grad
        grad = ops.gradient(grad, self.params[id(param)][0])
        _GRAD.__set__(param, grad)
        self._marked[id(param)] = (grad, grad._version)
        return grad

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARD_CALLS:
            self.backward_calls += 1
            self.in_backward = True
            try:
                # A forward that activation checkpointing re-runs inside backward (where this mode is
                # off) records the calls in the same forms as the first time.
                with fx_traceback.annotate({BACKWARD_KEY: self.backward_calls}), self._forward_reads(), equal_forms_patched():
                    return func(*args, **kwargs)
            finally:
                self.in_backward = False
        _refuse_rnn_dropout(func, args)
        decomposed = _decompose_tensor_value(func, args, kwargs)
        if decomposed is not None:
            return decomposed()
        func = equal_valued_form(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if _assigns_data(func):
            return _assign_data(*args)
        if name == "__get__" and getattr(func, "__self__", None) is _GRAD:
            grad = func(*args, **kwargs)
            entry = self.params.get(id(args[0]))
            return self._read_grad(args[0], grad) if entry is not None and entry[1] is args[0] else grad
        if self.in_backward or self.in_optimizer or name in _METADATA_READS or func in _METADATA_OPS:
            return func(*args, **kwargs)
        keep_first = _mutates_first_arg(func)
        args = tuple(a if (i == 0 and keep_first) else self._substitute(a) for i, a in enumerate(args))
        kwargs = {k: self._substitute(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _substitute(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            entry = self.params.get(id(value))
            return self._unshard_of(entry[0], value) if entry is not None and entry[1] is value else value
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._substitute(v) for v in value)
        return value


def _calling_user_line() -> str:
    """The innermost frame of the current call stack outside torch and spmd_expand, as
    ``File "...", line N: source`` (while tracing: the step's line that made the call)."""
    frames = [f for f in traceback.extract_stack() if not in_torch_or_spmd_expand(f.filename)]
    return f'File "{frames[-1].filename}", line {frames[-1].lineno}: {(frames[-1].line or "").strip()}' if frames else "<unknown source>"


_RNN_FUNCTIONS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


def _refuse_rnn_dropout(func: Callable, args: tuple) -> None:
    """Refuse a multi-layer RNN with dropout between its layers, in train mode.

    The trace records an RNN as torch's decomposition (``torch/_decomp/decompositions.py``,
    ``_rnn_helper``, which the step's CPU LSTM takes with oneDNN off), and that decomposition applies
    no dropout between layers (its condition ``num_layers < i - 1`` never holds), where one device's
    kernel does: the graph would train without it, silently (measured: loss 0.019800 vs 0.019314,
    outputs 0.057 apart, on one rank too).

    Raises:
        TraceError: naming the module's call, the user's line and the fix.
    """
    # torch.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    # (a PackedSequence's variant takes batch_sizes second, and is refused elsewhere).
    if getattr(func, "__name__", "") not in _RNN_FUNCTIONS or len(args) < 7 or not isinstance(args[3], bool):
        return
    num_layers, dropout, train = args[4], args[5], args[6]
    if train and dropout > 0 and num_layers > 1:
        where = _calling_user_line()
        raise TraceError(
            f"the train step at {where} runs a {num_layers}-layer {func.__name__.split('_')[0].upper()} with "
            f"dropout={dropout} between its layers in train mode: a compiled step records torch's decomposition of "
            f"the RNN (torch/_decomp/decompositions.py, _rnn_helper), which applies no dropout between layers, "
            f"where one device's kernel does, so it would train without that dropout\n"
            f"  fix: stack single-layer RNNs with nn.Dropout between them (nn.LSTM(num_layers=1) per layer, the "
            f"same parameters and values), or construct the RNN with dropout=0.0"
        )


def _assigns_data(func: Callable) -> bool:
    """Whether the torch function ``func`` is ``Tensor.data.__set__`` (``tensor.data = value``)."""
    return getattr(func, "__name__", "") == "__set__" and getattr(func, "__self__", None) is _DATA


def _assign_data(tensor: torch.Tensor, value: Any) -> None:
    """``tensor.data = value`` inside the traced step, recorded as ``tensor.copy_(value)`` under no_grad.

    make_fx does not see ``.data =`` (``Variable::set_data`` swaps the tensor's storage below the
    dispatcher): left alone, the graph drops the assignment with no error and the parameter keeps its
    old value. An in-place copy gives the tensor the same values. It differs from a storage swap only
    for another tensor aliasing the old storage and read after the assignment (``old = p.data``:
    unchanged on one device, changed by a copy), which :func:`_refuse_reads_of_assigned_data` refuses;
    a change of shape, dtype or device is refused here (the graph's inputs keep theirs).

    Raises:
        TraceError: naming the user's line, for an assignment a copy cannot stand for.
    """
    if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
        tensor.shape,
        tensor.dtype,
        tensor.device,
    ):
        shown = (
            f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}"
            if isinstance(value, torch.Tensor)
            else f"a {type(value).__name__}"
        )
        where = _calling_user_line()
        raise TraceError(
            f"the train step at {where} assigns {shown} to the .data of a {tensor.dtype} tensor of shape "
            f"{list(tensor.shape)} on {tensor.device}: a compiled step keeps the shape, dtype and device of the "
            f"model's parameters and buffers (they are graph inputs, placed by the plan)\n"
            f"  fix: assign a value of the same shape and dtype (`.to(dtype)`), or change the parameter outside "
            f"the compiled step (a new model or module, then the step compiles again)"
        )
    with torch.no_grad(), fx_traceback.annotate({DATA_ASSIGNMENT_KEY: True}):
        tensor.copy_(value)


def _aliased_input(node: Any) -> Any:
    """The node whose storage ``node``'s value shares: through views and in-place ops (which return
    their first argument), to the first node that made new storage."""
    while (
        isinstance(node, fx.Node)
        and isinstance(node.target, torch._ops.OpOverload)
        and node.args
        and node.target._schema.returns
        and node.target._schema.returns[0].alias_info is not None
    ):
        node = node.args[0]
    return node


def _refuse_reads_of_assigned_data(gm: fx.GraphModule) -> None:
    """Refuse a read, after ``p.data = value``, of a tensor that aliased ``p`` before it (``old = p.data``).

    On one device the assignment gives ``p`` new storage and ``old`` keeps the old values; the graph
    records the assignment as ``p.copy_(value)`` (:func:`_assign_data`), which ``old`` would see.

    Raises:
        TraceError: naming the read, the user's line and the fix.
    """
    assignments = [n for n in gm.graph.nodes if (n.meta.get("custom") or {}).get(DATA_ASSIGNMENT_KEY)]
    if not assignments:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    sharing: dict[Any, list[fx.Node]] = collections.defaultdict(list)  # storage -> nodes that alias it
    for node in gm.graph.nodes:
        sharing[_aliased_input(node)].append(node)
    for assignment in assignments:
        target = assignment.args[0]
        storage = _aliased_input(target)
        # The tensor assigned to, and what it is a view of: the same object before and after.
        itself = {target}
        while isinstance(target, fx.Node) and target is not storage:
            target = target.args[0]
            itself.add(target)
        for alias in sharing[storage]:
            if order[alias] >= order[assignment]:
                break
            if alias in itself:
                continue
            late = [user for user in alias.users if order[user] > order[assignment]]
            if late:
                raise node_error(
                    TraceError,
                    late[0],
                    "reads a tensor that aliased another one before its `.data` was assigned (e.g. `old = p.data`, "
                    "then `p.data = new`): on one device it keeps the old values, but the compiled step updates "
                    "the tensor in place, so it would read the new ones",
                    fix="keep the old value as a copy (`old = p.detach().clone()`), or update with "
                    "`with torch.no_grad(): p.copy_(new)` and no `.data` assignment",
                )


def _written_roots(node: fx.Node) -> list:
    """The storages (:func:`_aliased_input` roots) ``node`` writes in place, if it is an in-place op."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    values = written_values(node.target, node.args, node.kwargs)
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
    return [_aliased_input(v) for v in flat if isinstance(v, fx.Node)]


def _is_whole(node: Any, root: Any) -> bool:
    """Whether ``node``'s value is all of ``root``'s storage, laid out as ``root``: reached from it only
    through in-place ops (which return their first argument) and ``detach``/``alias``."""
    while node is not root:
        if not isinstance(node, fx.Node) or not isinstance(node.target, torch._ops.OpOverload):
            return False
        returned = node.target._schema.returns[0].alias_info if node.target._schema.returns else None
        if node.target not in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) and not (returned is not None and returned.is_write):
            return False
        node = node.args[0]
    return True


def _read_after(root: fx.Node, node: fx.Node, nodes: Sequence[fx.Node], order: Mapping[fx.Node, int]) -> bool:
    """Whether a node after ``node`` takes a value of ``root``'s storage (itself or an alias) as an input."""
    return any(
        _aliased_input(arg) is root
        for later in nodes[order[node] + 1:]
        for arg in later.all_input_nodes
    )


def _share_assigned_data(gm: fx.GraphModule, input_roles: Sequence[InputRole], outputs: Sequence[OutputRole]) -> None:
    """Keep ``p`` and ``value`` one tensor after ``p.data = value`` for the rest of the step.

    :func:`_assign_data` records the assignment as ``p.copy_(value)``; on one device ``p`` then shares
    ``value``'s storage, so an in-place write to either one (``value.add_(1)``, an optimizer step on
    ``p`` after SAM's ``p.data = state["old_p"]``) changes both. After every such write, the graph
    copies the written one into the other (the assignment checked that they have one shape and dtype),
    until ``p`` or ``value`` gets another storage (a later ``.data =``).

    That sharing outlives the call on one device (``p`` and ``value`` stay one tensor); the graph's
    next call has them as two inputs. Where that could show, refused: ``value`` is a graph input, or
    is kept after the call (returned, or stored as optimizer state whose input the step reads).

    Where ``value`` is part of a larger tensor's storage (``p.data = flat[i:j].view_as(p)``, torch's
    ``vector_to_parameters``), a write to one of them is refused if the other is read afterwards (a
    parameter always is: it outlives the call).

    Raises:
        TraceError: a sharing the graph cannot keep (above), naming the assignment's line and the fix.
    """
    assignments = [n for n in gm.graph.nodes if (n.meta.get("custom") or {}).get(DATA_ASSIGNMENT_KEY)]
    if not assignments:
        return
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    role_of = dict(zip(placeholders, input_roles))
    placeholder_of = {role: node for node, role in role_of.items()}
    returned = dict(zip(gm.graph.output_node().args[0], outputs))

    def refuse(assignment: fx.Node, why: str) -> TraceError:
        return node_error(
            TraceError, assignment,
            f"assigns a tensor's `.data` (`p.data = value`), after which on one device `p` and `value` are one "
            f"tensor: {why}",
            fix="copy the values instead (`with torch.no_grad(): p.copy_(value)`), so that `p` and `value` stay "
            "two tensors on one device too",
        )

    for assignment in assignments:
        target, value = assignment.args[0], assignment.args[1]
        target_root, value_root = _aliased_input(target), _aliased_input(value)
        if not isinstance(value, fx.Node) or value_root is target_root:
            continue
        if value_root.op == "placeholder":
            raise refuse(assignment, f"`value` is the step's input {role_of.get(value_root)}, and stays one tensor with "
                                     f"`p` after the call, which a compiled step cannot keep")
        kept = returned.get(value_root)
        if kept is not None:
            again = placeholder_of.get(InputRole(kept.kind, kept.fqn, kept.key)) if kept.kind == "state" else None
            if kept.kind != "state" or (again is not None and again.users):
                raise refuse(assignment, f"`value` outlives the call ({kept}) as one tensor with `p`, which a "
                                         f"compiled step cannot keep")
        whole = _is_whole(target, target_root) and _is_whole(value, value_root)
        mirrors = []
        for node in nodes[order[assignment] + 1:]:
            if (node.meta.get("custom") or {}).get(DATA_ASSIGNMENT_KEY) and _aliased_input(node.args[0]) in (target_root, value_root):
                break  # `p` or `value` gets another tensor's storage: no longer one tensor
            roots = _written_roots(node)
            hit = {r for r in roots if r is target_root or r is value_root}
            if not hit:
                continue
            if len(hit) > 1:
                raise refuse(assignment, f"{node.target} writes both of them at once")
            written = hit.pop()
            other = value_root if written is target_root else target_root
            if whole:
                mirrors.append((node, other, written))
            elif other is target_root or other in returned or _read_after(other, node, nodes, order):
                # `p = flat[i:j].view_as(p)` (torch's vector_to_parameters): `p` is part of `flat`'s storage;
                # a write to one matters where the other is read afterwards (a parameter always is).
                raise refuse(assignment, f"{node.target} writes one of them, and the other, which shares only part "
                                         f"of its storage (e.g. a slice of a flat vector), is read afterwards")
        for node, destination, source in mirrors:
            with gm.graph.inserting_after(node):
                mirror = gm.graph.call_function(torch.ops.aten.copy_.default, (destination, source))
            mirror.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            if "val" in destination.meta:
                mirror.meta["val"] = destination.meta["val"]
    gm.recompile()


@contextlib.contextmanager
def _optimizer_on(
    optimizer: Optional[torch.optim.Optimizer],
    swap: dict[int, torch.Tensor],
    states: dict[int, dict[str, Any]],
    hyperparameters: Sequence[HyperParameter],
    values: Sequence[Any],
    group_writes: list,
) -> Iterator[None]:
    """Point ``optimizer`` at the traced parameters, states and hyperparameters while the step is traced.

    An int or bool setting the step sets (a step count some optimizers keep in the param group, timm's
    ``group["step"] += 1``) is appended to ``group_writes`` as (group index, key, value) and stored back
    after every run of the graph, as Python-number states are (:func:`_python_state_writes`).

    Raises:
        TraceError: the step changed any other param-group setting (e.g. an LR scheduler stepped inside
            the step): the compiled step would not repeat that change, so it is refused.
    """
    if optimizer is None:
        yield
        return
    saved_params = [g["params"] for g in optimizer.param_groups]
    saved_settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    holders = [holder for _, holder in optimizer_state.holders(optimizer)]
    saved_states = [holder.state for holder in holders]
    traced_states: dict[int, collections.defaultdict] = {id(holder): collections.defaultdict(dict) for holder in holders}
    for group in optimizer.param_groups:
        group["params"] = [swap[id(p)] for p in group["params"]]
    for hp, value in zip(hyperparameters, values):
        if not isinstance(hp, HyperParameter):  # a float argument of the step
            continue
        group = optimizer.param_groups[hp.group]
        if hp.key == "lr" and group.get("fused"):
            # Fused kernels take a float lr as a constant; their tensor-lr overload keeps it an input
            # (float64: the value the kernel reads is the float the eager step passes).
            group[hp.key] = torch.scalar_tensor(value, dtype=torch.float64)
        elif hp.index is None:
            group[hp.key] = value
        else:
            group[hp.key] = tuple(value if i == hp.index else v for i, v in enumerate(group[hp.key]))
    traced_settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for pid, st in states.items():
        if not st:
            traced_states[id(optimizer)][swap[pid]] = {}  # an empty state stays
        for key, value in st.items():
            holder, own = optimizer_state.split_key(optimizer, key)
            traced_states[id(holder)][swap[pid]][own] = value
    for holder in holders:
        holder.state = traced_states[id(holder)]
    try:
        yield
        for i, (group, expected) in enumerate(zip(optimizer.param_groups, traced_settings)):
            changed = sorted(k for k in set(group) | set(expected) if k != "params" and group.get(k) is not expected.get(k))
            counts = [k for k in changed if k in group and type(group[k]) in (int, bool) and type(expected.get(k)) in (int, bool, type(None))]
            group_writes.extend((i, k, group[k]) for k in counts)
            recounted = [k for k in counts if expected.get(k) is not None]
            if recounted:
                warnings.warn(
                    f"spmd.compile: the step changes optimizer.param_groups[{i}][{recounted[0]!r}] from "
                    f"{expected[recounted[0]]!r} to {group[recounted[0]]!r}, a Python value: the compiled graph bakes it "
                    f"in, so each call compiles again (right values, slowly). Keep counts in tensors updated in place, "
                    f"as torch's optimizers keep `step`",
                    stacklevel=2,
                )
            changed = [k for k in changed if k not in counts]
            if changed:
                raise TraceError(
                    f"the train step changed optimizer.param_groups[{i}] settings {changed}; a compiled step "
                    f"cannot repeat that on later calls.\n  fix: change hyperparameters outside the step (call "
                    f"scheduler.step() after the compiled step); their values are read on every call"
                )
    finally:
        for holder, saved in zip(holders, saved_states):
            holder.state = saved
        for group, params, settings in zip(optimizer.param_groups, saved_params, saved_settings):
            group["params"] = params
            for key in [k for k in group if k != "params" and k not in settings]:
                del group[key]  # set by the step: stored back after the graph runs, if kept
            group.update(settings)


def _copy_tensor_hooks(real: torch.Tensor, traced: torch.Tensor) -> None:
    """Register ``real``'s gradient hooks (``register_hook``) and post-accumulate-grad hooks on the
    tensor that stands for it while tracing, so the graph does what they do, to the gradient of the
    global batch (the single-device meaning; torch DDP runs them on each rank's unreduced gradient)."""
    for hook in (real._backward_hooks or {}).values():
        traced.register_hook(_recording_data_assignments(hook))
    for hook in (getattr(real, "_post_accumulate_grad_hooks", None) or {}).values():
        traced.register_post_accumulate_grad_hook(_recording_data_assignments(hook))


def _recording_data_assignments(hook: Callable) -> Callable:
    """``hook``, run with ``.data =`` recorded as :func:`_assign_data` records it: backward runs the
    hook outside the step's torch-function mode, where make_fx would drop the assignment."""

    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        with _DataAssignments():
            return hook(*args)

    return run


class _DataAssignments(TorchFunctionMode):
    """Records ``tensor.data = value`` as :func:`_assign_data`; every other call passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _assigns_data(func):
            return _assign_data(*args)
        return func(*args, **(kwargs or {}))


def _fake(fake_mode: FakeTensorMode, spec: TensorSpec) -> torch.Tensor:
    # Only metadata is read; on CPU untouched pages of an empty tensor cost no memory.
    template = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
    context = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in spec.dynamic_dims else DimDynamic.STATIC for d in range(len(spec.shape))]
    )
    return fake_mode.from_tensor(template, symbolic_context=context)


def _refuse_host_reads(gm: fx.GraphModule) -> None:
    """A step that reads a tensor's value into Python cannot be compiled: the value does not exist
    while tracing, and a compiled graph would keep one step's value for every later step."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten._local_scalar_dense.default:
            raise TraceError(
                f"the step reads a tensor's value into Python (`.item()`, `.tolist()`, `float(t)`, `int(t)`) at "
                f"{user_source_line(node)}\n"
                f"  fix: keep the value a tensor inside the step (e.g. `loss * scale` with `scale` a tensor), or "
                f"return the tensor from the step and read it after the call"
            )


def step_functions(fn: Callable[..., Any], model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[list[Callable], list[Any], list[type]]:
    """The user's functions a trace of ``fn`` runs, whose code is read for the values it uses: the
    step, each ``forward`` of the model's module classes, the hooks (and the objects holding them),
    and the methods these call by name (``self.helper(x)``, ``model.compute_loss(batch)``) of the
    model's classes and of the optimizer's and the optimizers' it wraps (a Lookahead's base).
    Returns (functions, hook objects, those classes)."""
    hooked, hook_objects = hook_functions(model, optimizer)
    functions = [fn, *forward_functions(model), *hooked]
    owners = [type(m) for m in model.modules()]
    owners += [type(holder) for _, holder in optimizer_state.holders(optimizer)] if optimizer is not None else []
    functions += called_methods(functions, owners)
    return functions, hook_objects, owners


def step_float_constants(fn: Callable[..., Any], model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[FloatConstant]:
    """Where the step's code reads Python floats that are graph inputs (:class:`FloatConstant`, from
    :func:`~spmd_expand.python_values.float_places` over :func:`step_functions`): globals, closure
    variables, and plain attributes of settings objects and of the user's own modules of ``model``."""
    functions, _, _ = step_functions(fn, model, optimizer)
    return [FloatConstant(label, place) for label, place in float_places(functions, model)]


@contextlib.contextmanager
def _floats_in_place(hyperparameters: Sequence[Any], values: Sequence[Any]) -> Iterator[None]:
    """While inside, each :class:`FloatConstant`'s place holds its graph input (a ``SymFloat``); the
    original float is put back after, also when tracing fails. A place the step assigned meanwhile in
    a way :func:`~spmd_expand.python_values.float_places` does not see (``setattr``, library code) is
    a :class:`TraceError`: the compiled step then traces with the values (its assignment is replayed
    after each call), instead of losing the assignment to the put-back."""
    placed = [(hp, hp.place(), value) for hp, value in zip(hyperparameters, values) if isinstance(hp, FloatConstant)]
    try:
        for hp, _, value in placed:
            hp.place.write(value)
        yield
    finally:
        assigned = [hp.label for hp, _, value in placed if hp.place() is not value]
        for hp, original, _ in reversed(placed):
            hp.place.write(original)
    if assigned:
        raise TraceError(f"the step assigns {', '.join(assigned)}, a float it reads that would be a graph input")


def step_tensor_constants(fn: Callable[..., Any], model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[TensorConstant]:
    """Where the step reads tensors that are neither its arguments nor the model's or the
    optimizer's (:func:`~spmd_expand.python_values.tensor_constants` over :func:`step_functions`):
    graph inputs, read on every call."""
    functions, _, _ = step_functions(fn, model, optimizer)
    return tensor_constants(functions, model, optimizer)


@contextlib.contextmanager
def _constants_in_place(constants: Mapping[str, TensorConstant], by_role: Mapping[InputRole, Any]) -> Iterator[None]:
    """While inside, each constant's place holds the graph input that stands for it (a fake tensor);
    the original is put back after. A place the step assigned meanwhile (``W = W * 0.9``) is a
    :class:`TraceError`: the new tensor would live only in the trace."""
    placed = []
    try:
        for role, value in by_role.items():
            if role.kind == "constant":
                constant = constants[role.key]
                placed.append((constant, constant.read(), value))
                constant.write(value)
        yield
    finally:
        assigned = [c.label for c, _, value in placed if c.read() is not value]
        for constant, original, _ in reversed(placed):
            constant.write(original)
    if assigned:
        raise TraceError(
            f"the step assigns a new tensor to {', '.join(assigned)}, a tensor it reads and that is not "
            f"its argument, the model's or the optimizer's: the compiled graph takes it as an input on "
            f"every call and cannot assign it\n  fix: update it in place (`W.mul_(0.9)`), register it on the "
            f"model (`model.register_buffer(name, tensor)`), or assign it outside the compiled step"
        )


def trace_step(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    input_roles: list[InputRole],
    input_specs: list[TensorSpec],
    module_layouts: Optional[Mapping[str, list]] = None,
    mixed_precision: Optional[MixedPrecision] = None,
    parameter_hooks: bool = True,
    float_args: Sequence[FloatArgument] = (),
    tensor_constants: Sequence[TensorConstant] = (),
    grad_enabled: bool = True,
    warn_trace_time_python: bool = True,
) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` into a functional global graph.

    Args:
        fn: the user's train step; ``model`` and ``optimizer`` appear among ``args``/``kwargs``.
        module_layouts: module FQN -> [(mesh dim, :class:`~spmd_expand.boundaries.BoundaryLayouts`)]:
            where ``layout`` markers go (tensor-parallel module boundaries).
        mixed_precision: parameters read in another dtype and the root's input/output casts
            (:meth:`spmd_expand.plans.ResolvedPlan.mixed_precision`); None: none.
        parameter_hooks: register each parameter's gradient and post-accumulate-grad hooks on the
            tensor that stands for it, so the trace runs them (False: the caller's autograd runs them).
        float_args: the float arguments of the step (:func:`float_arguments`) and the floats it reads
            from globals and closure variables (:func:`step_float_constants`) that are graph inputs,
            after the optimizer's hyperparameters; the others are traced with their values.
        tensor_constants: the places of the tensors the step reads from elsewhere that are graph
            inputs (:func:`step_tensor_constants`): each has a ``constant`` input role labelled with
            its place, and its input stands in there while the step is traced.
        grad_enabled: the caller's grad mode. The step is traced with gradients on; where one device's
            code path depends on the caller's mode (:func:`~spmd_expand.forms.encoder_nested_fast_path`)
            it takes this one, and the graph is guarded on it (:func:`_switch_guards`).
        warn_trace_time_python: warn where the step's Python code prints or assigns, which runs only
            while it is traced (``spmd.compile``); False where Dynamo captured ``fn``'s graph and runs
            that Python itself on every call (the ``torch.compile`` backend).
        input_roles / input_specs: one entry per graph input, with global shapes. Batch inputs
            (``kind == "batch"``, ``key`` = index among the tensor leaves of ``(args, kwargs)``) take
            the place of those leaves; param/buffer/grad/state inputs replace the model's and
            optimizer's tensors.

    Returns:
        A :class:`TracedStep`. New optimizer states and gradients left set by the step are outputs;
        mutated inputs are ``aten.copy_`` nodes into their placeholders.

    Raises:
        TraceError: the step has data-dependent control flow, returns non-tensors, keeps a tensor it
            computed in Python state that outlives it (:func:`_settle_state_changes`), assigns a
            parameter (:func:`_write_back_assignments`), draws from Python's ``random`` or
            ``numpy.random`` or seeds torch (:func:`_refuse_untraced_randomness`), or fails to trace.
            Python state the failed trace changed is put back first.
    """
    # make_fx keeps the stack traces of frames inside nn.Module.forward only; the step's own lines
    # (the loss, the optimizer call) are kept when its function is registered as an anchor.
    torch.fx.proxy._register_stack_trace_anchor(fn)
    global_state = GlobalState()  # before tracing changes grad mode or anything else
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    shape_env = fake_mode.shape_env
    fakes = [_fake(fake_mode, s) for s in input_specs]
    leaves, tree = pytree.tree_flatten((args, kwargs))
    hyperparameters: list = [*hyperparameters_of(optimizer), *float_args]
    hints = [hp.read(optimizer, leaves) for hp in hyperparameters]
    symbols = [
        shape_env.create_unspecified_symbol(hint, ConstantSource(str(hp)), DimDynamic.DYNAMIC)
        for hp, hint in zip(hyperparameters, hints)
    ]
    sym_values = [
        shape_env.create_symfloatnode(sym, hint=hint, source=ConstantSource(str(hp)))
        for sym, hp, hint in zip(symbols, hyperparameters, hints)
    ]
    tensor_leaf_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    real_params = dict(model.named_parameters())
    fqn_of = {id(p): fqn for fqn, p in real_params.items()}
    # Param groups on the default path, which reads scalar states (Adam's `step`) as Python floats.
    eager_scalar_fqns = {
        fqn_of[id(p)]
        for g in (optimizer.param_groups if optimizer is not None else ())
        if not g.get("fused") and not g.get("capturable")
        for p in g["params"]
    }
    outputs: list[OutputRole] = []
    recorded: list = []
    cleared_grads: list[str] = []
    state_writes: list[tuple[str, str, Any]] = []
    group_writes: list[tuple[int, str, Any]] = []
    python_states_before: dict[str, dict[str, Any]] = {}
    return_spec: list[tuple[pytree.TreeSpec, list[bool]]] = []

    def step(*flat: Any) -> list[torch.Tensor]:
        by_role = dict(zip(input_roles, flat))
        hp_values = flat[len(input_roles):]
        params = {r.fqn: nn.Parameter(t, requires_grad=real_params[r.fqn].requires_grad) for r, t in by_role.items() if r.kind == "param"}
        for fqn, p in params.items() if parameter_hooks else ():
            _copy_tensor_hooks(real_params[fqn], p)
        buffers = {r.fqn: t for r, t in by_role.items() if r.kind == "buffer"}
        swap = {id(real_params[fqn]): p for fqn, p in params.items()}
        mode = _StepMode(
            {id(p): (fqn, p) for fqn, p in params.items()}, mixed_precision.casts if mixed_precision else {}, model
        )
        states: dict[int, dict[str, Any]] = {}
        if optimizer is not None:
            for p, st in optimizer_state.items(optimizer):
                # Non-tensor state (e.g. SGD's momentum_buffer=None) is carried over as is.
                states[id(p)] = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        for r, t in by_role.items():
            if r.kind == "state":
                states.setdefault(id(real_params[r.fqn]), {})[r.key] = t
            elif r.kind == "grad":
                params[r.fqn].grad = t
                mode.mark_read(params[r.fqn], t)
        inputs_by_id = {id(t): r for r, t in by_role.items()}
        states_before = {pid: {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)} for pid, st in states.items()}
        widened = _widen_scalar_states(by_role, states, real_params, eager_scalar_fqns)

        batch = {int(r.key): t for r, t in by_role.items() if r.kind == "batch"}
        new_leaves = list(leaves)
        for i, pos in enumerate(tensor_leaf_positions):
            new_leaves[pos] = batch[i]
        for hp, value in zip(hyperparameters, hp_values):
            if isinstance(hp, FloatArgument):
                new_leaves[hp.position] = value
        call_args, call_kwargs = pytree.tree_unflatten(new_leaves, tree)

        # The module and the optimizer hold the same leaves; _StepMode marks where they are read.
        # torch writes the tensors the module holds when the context exits back into this dict, so an
        # attribute assignment of a parameter or buffer inside the step (`self.ema = 0.9 * self.ema + ...`)
        # shows up here (see _write_back_assignments).
        held = {**params, **buffers}
        group_writes.clear()
        with stateless._reparametrize_module(model, held, tie_weights=True), _optimizer_on(
            optimizer, swap, states, hyperparameters, hp_values, group_writes
        ), mode.optimizer_step(optimizer), mark_boundaries(model, module_layouts or {}), mark_sequence_first(
            model
        ), _cast_root_io(model, mixed_precision.policy if mixed_precision else None), mode:
            with record_reads(model, settings_objects) as reads, _constants_in_place(constants_by_label, by_role), \
                    _floats_in_place(hyperparameters, hp_values):
                result = fn(*call_args, **call_kwargs)
            recorded[:] = [reads]
            for original, wide, fqn, key in widened:
                original.copy_(wide)
                if optimizer_state.param_state(optimizer, params[fqn]).get(key) is wide:
                    optimizer_state.set_state(optimizer, params[fqn], key, original)
            found = optimizer_state.holders(optimizer) if optimizer else []
            traced_states = {fqn: optimizer_state.param_state(optimizer, params[fqn], found) for fqn in params} if optimizer else {}
        _write_back_assignments(held, params, buffers)

        ret_leaves, spec = pytree.tree_flatten(result)
        for leaf in ret_leaves:
            if leaf is not None and not isinstance(leaf, torch.Tensor):
                raise TraceError(
                    f"the train step returned a {type(leaf).__name__}; return tensors (e.g. `loss`, not "
                    f"`loss.item()`), which spmd_expand reduces or gathers to their single-device value"
                )
        return_spec.append((spec, [leaf is not None for leaf in ret_leaves]))
        out: list[torch.Tensor] = []
        outputs.clear()
        for leaf in ret_leaves:
            if leaf is not None:
                outputs.append(OutputRole("return"))
                out.append(leaf)
        for fqn, st in traced_states.items():
            for key, value in st.items():
                # A state mutated in place is written back through copy_; anything else is new.
                if isinstance(value, torch.Tensor) and inputs_by_id.get(id(value)) != InputRole("state", fqn, key):
                    outputs.append(OutputRole("state", fqn, key))
                    out.append(value)
        cleared_grads[:] = [r.fqn for r in by_role if r.kind == "grad" and params[r.fqn].grad is None]
        python_states_before.clear()
        python_states_before.update({fqn: states_before.get(id(real_params[fqn]), {}) for fqn in traced_states})
        state_writes[:] = _python_state_writes(traced_states, python_states_before)
        for fqn, p in params.items():
            if p.grad is not None and inputs_by_id.get(id(p.grad)) != InputRole("grad", fqn):
                outputs.append(OutputRole("grad", fqn))
                # A gradient already marked where it was read is marked again here: an identity.
                out.append(ops.gradient(p.grad, fqn))
        return out

    modes_before = {fqn: m.training for fqn, m in model.named_modules()}
    user_functions, hook_objects, owners = step_functions(fn, model, optimizer)
    # The floats read from globals that are graph inputs: their places are inputs, not guards.
    lifted_floats = {hp.label for hp in hyperparameters if isinstance(hp, FloatConstant)}
    constants_by_label = {c.label: c for c in tensor_constants}
    optimizers = user_optimizers(optimizer)
    # torch's optimizers too, for their reads only: an attribute the user set on one and the step reads
    # (`loss * optimizer.loss_scale`) is baked in like a module's.
    read_only = [
        (f"the {type(holder).__qualname__} optimizer", holder)
        for _, holder in (optimizer_state.holders(optimizer) if optimizer is not None else [])
        if all(holder is not o for _, o in optimizers)
    ]
    settings_objects = settings_variables(user_functions) + [(label, o, lambda o=o: o) for label, o in optimizers + read_only]
    state = StateWatch(user_functions, model, objects=hook_objects, labelled=optimizers)
    randomness = RandomStateUse()
    try:
        with torch.compiler._compile_session_context(), torch.enable_grad():
            # _compile_session_context: optimizers take their traceable paths (`step` stays a tensor,
            # no .item()), with the same arithmetic as their default eager path.
            # _non_strict_tracing_context: selective activation checkpointing takes its eager path
            # (saves what its policy saves, recomputes the rest inside backward, where make_fx
            # records it) instead of only tagging nodes for AOTAutograd's partitioner.
            # mkldnn off: an LSTM on CPU is recorded as its decomposition into matmuls and pointwise ops
            # (torch._decomp's one_layer_lstm, which DTensor places), not as one oneDNN kernel
            # (mkldnn_rnn_layer), which it cannot. Kernels are chosen again when the graph runs.
            # force_eager: a model or module the user wrapped in torch.compile (`model.compile()`,
            # nanoGPT's `model = torch.compile(model)`) runs its Python forward, which make_fx records;
            # the whole step is compiled here instead.
            # RecordStackTraces: the nodes' stack traces, once per torch call of the step instead of
            # once per node by the tracer (stack_traces.py).
            with fx_traceback.preserve_node_meta(), RecordStackTraces(), MarkLossParallel(), \
                    torch.compiler._non_strict_tracing_context(), randomness, _onednn_off(), \
                    torch.compiler.set_stance("force_eager"), encoder_nested_fast_path(grad_enabled) as switch_reads:
                autograd_graph = make_fx(step, tracing_mode="symbolic", record_stack_traces=True)(*fakes, *sym_values)
            _refuse_collectives(autograd_graph)
            _refuse_untraced_randomness(randomness)
            _refuse_hidden_state_uses(state)
            _refuse_recomputed_draws(autograd_graph)
            _refuse_writes_to_parameter_reads(autograd_graph)
            _refuse_reads_of_assigned_data(autograd_graph)
            _share_assigned_data(autograd_graph, input_roles, outputs)
            _refuse_storage_swaps(autograd_graph)
            functional = functionalize_graph(autograd_graph, _decompositions(), skip=_is_profiler_node)
            if functional is None:  # a write through a view, or an op without a functional twin
                functional = _functionalize_by_tracing(autograd_graph, fakes, sym_values)
        _refuse_host_reads(functional)
        python_writes = _settle_state_changes(state.changes(), _SymbolicScalars(shape_env, symbols))
    except SpmdError:  # ours, clear already (a PlanError from the optimizer check, a TraceError)
        _undo(state)
        randomness.restore()
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes one clear error
        _undo(state)
        randomness.restore()
        kind = type(e).__name__
        data_dependent = "DataDependent" in kind or "data-dependent" in str(e).lower()
        if _NON_FAKE_INPUT in str(e):
            raise TraceError(
                f"the step computes with a tensor it was not handed (a global, a closure's or another object's "
                f"tensor) at {_user_frame(e)}: {str(e).split('Found in ')[-1].splitlines()[0]}\n"
                f"  spmd.compile makes graph inputs of the step's tensor arguments (this rank's batch), the model's "
                f"parameters and buffers, the optimizer's state, and the tensors that need no gradient held by a "
                f"global, a closure variable or a default argument of the step's code (or a list or dict there), "
                f"or by a module held there "
                f"(`criterion = nn.CrossEntropyLoss(weight=w)`) or as a plain attribute of a settings object there, "
                f"of the object a method step belongs to or of a module of the model; this one is held elsewhere "
                f"(in a tuple, deeper in an object or a container), needs a gradient or is not contiguous, and would be baked into the graph "
                f"and never updated\n"
                f"  fix: register it on the model (`model.register_buffer(name, tensor)`: replicated, read and "
                f"written every step; a learnable one as a parameter), hold it in a global the step reads (a "
                f"contiguous one: `.contiguous()`), or "
                f"move the code that uses it out of the compiled step (e.g. `ema.update_parameters(model)` after "
                f"the call)"
            ) from e
        if optimizer is not None and _raised_in_optimizer(e):
            where = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}.step()"
            hint = _optimizer_hint(optimizer, data_dependent)
        else:
            library = _library_frame(e)
            where = f"the train step at {_user_frame(e)}{library}"
            hint = _trace_failure_hint(kind, str(e), data_dependent, library, _user_frame(e))
        raise TraceError(f"could not trace {where}: {kind}: {str(e).splitlines()[0] if str(e) else ''}\n  fix: {hint}") from e

    _warn_changed_python_states(state_writes, python_states_before)
    for write in code_writes([fn]) if warn_trace_time_python else ():
        warnings.warn(
            f"spmd.compile: the step assigns {write}; a compiled step's Python code runs when it is traced "
            f"(the first call and each recompilation), not on every call: a Python number it assigns is "
            f"assigned again after each call (and one it also reads compiles once per value), anything else "
            f"only when traced; keep such bookkeeping outside the compiled step, or in a buffer it updates",
            stacklevel=2,
        )
    for where in code_prints(user_functions) if warn_trace_time_python else ():
        warnings.warn(
            f"spmd.compile: the step calls print() at {where}; a compiled step's Python code runs when it is "
            f"traced (the first call and each recompilation), where tensors are stand-ins without values "
            f"(FakeTensor), not on every call: return the values from the step and print them after the call",
            stacklevel=2,
        )
    functional.graph.eliminate_dead_code()
    _drop_profiler_nodes(functional)
    functional.recompile()
    spec, is_tensor = return_spec[-1]
    return TracedStep(
        functional,
        list(input_roles),
        list(outputs),
        list(input_specs),
        spec,
        is_tensor,
        list(cleared_grads),
        fake_mode,
        hyperparameters,
        _hyperparameter_guards(shape_env, symbols, hyperparameters, hints),
        PythonGuards(
            [v for v in code_reads(user_functions) + class_attribute_reads(user_functions, owners) + recorded[-1].values
             if v.description not in lifted_floats] + _switch_guards(switch_reads),
            global_state,
            recorded[-1].module_reads,
            CodeIdentity(user_functions, owners, [holder for _, holder in optimizer_state.holders(optimizer)] if optimizer is not None else []),
            HeldModules(settings_objects, model),
        ),
        list(state_writes),
        list(group_writes),
        [(fqn, m.training) for fqn, m in model.named_modules() if modes_before.get(fqn) != m.training],
        python_writes,
    )


_SWITCHES = {
    "grad_mode": ("the grad mode of the call (torch.is_grad_enabled(): torch.no_grad() around it or not)", torch.is_grad_enabled),
    "mha_fastpath": ("torch.backends.mha.get_fastpath_enabled()", torch.backends.mha.get_fastpath_enabled),
}


def _switch_guards(reads: Mapping[str, bool]) -> list[PythonValue]:
    """Guarded values for the global switches a code path of the trace depended on
    (:func:`~spmd_expand.forms.encoder_nested_fast_path`): the call's grad mode, torch's MHA fast path."""
    return [PythonValue(*_SWITCHES[name], value) for name, value in reads.items()]


def _python_state_writes(traced: Mapping[str, Mapping[str, Any]], before: Mapping[str, Mapping[str, Any]]) -> list:
    """The non-tensor optimizer states the step set: (fqn, key, value) for each one new or changed.

    A custom optimizer may count steps in a Python int (``state["step"] += 1``): the trace runs its
    Python once, so the graph bakes in that call's count. The count is stored back after every run of
    the graph (the graph is keyed on the count it was traced from, :func:`~spmd_expand.guards.cache_key`),
    so the next call, with the next count, compiles again: right values, one compilation per step
    (:func:`_warn_changed_python_states` says so). Without the write-back, every call repeated the
    first call's bias correction.

    Raises:
        TraceError: a state set to a value computed from a hyperparameter (a symbolic number while
            traced; it has no value to store).
    """
    writes = []
    for fqn, state in traced.items():
        old = before.get(fqn, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) or (key in old and old[key] is value):
                continue
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise TraceError(
                    f"the optimizer stores state[{key!r}] of parameter {fqn} as a Python number computed from a "
                    f"hyperparameter (an input of the compiled step, with no value while it is traced)\n  fix: keep "
                    f"it a tensor (`torch.as_tensor(...)`), as torch's optimizers keep `step`"
                )
            writes.append((fqn, key, value))
    return writes


def _warn_changed_python_states(writes: Sequence[tuple[str, str, Any]], before: Mapping[str, Mapping[str, Any]]) -> None:
    """One warning for the non-tensor optimizer states the step changed (each call compiles again)."""
    changed = [(fqn, key, value) for fqn, key, value in writes if key in before.get(fqn, {})]
    if not changed:
        return
    fqn, key, value = changed[0]
    warnings.warn(
        f"spmd.compile: the optimizer's step changes Python values in its state ({len(changed)}, e.g. "
        f"state[{key!r}] of parameter {fqn} from {before[fqn][key]!r} to {value!r}): the compiled graph bakes "
        f"them in, so each call compiles again (right values, slowly). Keep them tensors updated in place "
        f"(`state[{key!r}] = torch.tensor(0.0)`), as torch's optimizers keep `step`",
        stacklevel=3,
    )


@contextlib.contextmanager
def _onednn_off() -> Iterator[None]:
    """oneDNN (mkldnn) kernels off, and back as they were (``torch.backends.mkldnn.flags`` would also
    set the TF32 flag, which warns on every CPU build)."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _refuse_untraced_randomness(randomness: RandomStateUse) -> None:
    """Refuse a step that, while traced, drew from Python's ``random`` or numpy's global random state,
    or seeded torch's generator (:class:`~spmd_expand.python_values.RandomStateUse`): either would
    happen once, where one device does it on every step. A draw's outcome is baked into the graph
    (HuggingFace wav2vec2's SpecAugment masks come from ``np.random``; LayerDrop in some models from
    ``random.uniform``); a seeding is not repeated, so from the second call on the step's torch draws
    (dropout masks) differ from one device's.

    Raises:
        TraceError: naming where and the fix.
    """
    if randomness.seeded:
        raise TraceError(
            f"the step seeds torch's random number generator ({'; '.join(randomness.seeded)}). The seeding "
            f"runs when the step is traced, once: every later call draws (dropout masks, torch.rand) from "
            f"wherever the generator is then, where one device would start again from the seed\n"
            f"  fix: seed before calling the compiled step (`torch.manual_seed(s); step(...)`), on every rank alike"
        )
    if not randomness.drew:
        return
    where = "; ".join(randomness.where) if randomness.where else "a function of random or numpy.random called by another name"
    raise TraceError(
        f"the step draws random numbers with Python's random module or numpy.random ({where}). Those run "
        f"when the step is traced, once, and the graph keeps what they chose (which layers to drop, which "
        f"positions to mask), so every call would repeat the same draw\n"
        f"  fix: draw with torch (torch.rand, torch.bernoulli, torch.randperm: the compiled step draws them on "
        f"every call, as one device does), or turn that randomness off (HuggingFace audio models: "
        f"config.mask_time_prob=0.0, mask_feature_prob=0.0, layerdrop=0.0)"
    )


def _refuse_hidden_state_uses(state: StateWatch) -> None:
    """Refuse a step that, while traced, drew from a random generator object (``random.Random()``,
    numpy's ``default_rng()``) or advanced an iterator (``next(self.counter)`` of an
    ``itertools.count()``, a generator yielding a schedule) that outlives the call: that runs once,
    when the step is traced, and the graph keeps the value it gave, so every call would repeat it.
    Their state is below their Python attributes (:meth:`~spmd_expand.python_values.StateWatch.hidden_uses`).

    Raises:
        TraceError: naming each object, where it is held, and the fix. Random generators are put back
            (:func:`_undo`); an iterator cannot be, and the message says so.
    """
    uses = state.hidden_uses()
    if not uses:
        return
    draws = [u for u in uses if u.is_random]
    advanced = [u for u in uses if not u.is_random]
    parts = []
    if draws:
        parts.append(
            f"draws random numbers from {', '.join(f'{u.label} (a {u.kind})' for u in draws)}. That runs when the "
            f"step is traced, once, and the graph keeps what it drew, so every call would repeat the same draw "
            f"(the generator is put back as it was)"
        )
    if advanced:
        parts.append(
            f"advances {', '.join(f'{u.label} (a {u.kind})' for u in advanced)} (`next(it)`). That runs when the "
            f"step is traced, once, and the graph keeps the value it gave, so every call would repeat it (an "
            f"iterator cannot be rewound: it stays advanced by this call)"
        )
    fixes = []
    if draws:
        fixes.append(
            "draw with torch (torch.rand, torch.randint, torch.bernoulli: the compiled step draws them on every "
            "call, as one device does), or draw outside the step and pass the value in as a float argument (a "
            "graph input)"
        )
    if advanced:
        fixes.append(
            "for a counter or schedule, keep a Python number in an attribute the step updates (`self.calls += 1`: "
            "assigned again after every call), or take the next value outside the step and pass it in as a "
            "float argument (a graph input)"
        )
    raise TraceError(f"the step {'; and it '.join(parts)}\n  fix: {'; '.join(fixes)}")


def _undo(state: StateWatch) -> None:
    """Put back every change a failed trace made to the Python state it watched, and the random
    generators it drew from: a refused step loses nothing (an iterator it advanced cannot be put back)."""
    for change in state.changes():
        change.undo()
    state.rewind()


class _SymbolicScalars:
    """Symbolic numbers of a trace as functions of the call's hyperparameter values: a number the step
    computed from a float input and kept (``self.last_lam = lam``, ``self.lr = group["lr"]``) is the
    value of its expression on each call. Sizes are fixed by the cache key: their traced values."""

    _TYPES = {torch.SymFloat: float, torch.SymInt: int, torch.SymBool: bool}

    def __init__(self, shape_env: ShapeEnv, symbols: list[sympy.Symbol]):
        self.symbols = list(symbols)
        self.sizes = {s: v for s, v in shape_env.backed_var_to_val.items() if s not in set(self.symbols)}

    def covers(self, value: Any) -> bool:
        """Whether ``value`` is a plain scalar, or a symbolic one of hyperparameters and sizes only."""
        if type(value) not in self._TYPES:
            return True
        return value.node.expr.free_symbols <= set(self.symbols) | set(self.sizes)

    def resolver(self, values: Sequence[float]) -> Callable[[Any], Any]:
        """``resolve(value)``: a symbolic scalar's value for hyperparameter ``values``; others as they are."""
        bound = {**self.sizes, **{s: sympy.Float(float(v)) for s, v in zip(self.symbols, values)}}

        def resolve(value: Any) -> Any:
            cast = self._TYPES.get(type(value))
            return value if cast is None else cast(value.node.expr.xreplace(bound))

        return resolve


def _settle_state_changes(changes: list[StateChange], scalars: _SymbolicScalars) -> list[Callable[[Sequence[float]], None]]:
    """What to do with each change the traced step made to Python state that outlives it
    (:class:`~spmd_expand.python_values.StateChange`). The step's Python runs when it is traced, not
    on every call, and its tensors and sizes exist only while tracing, so:

    * a tensor or size of the trace kept in a global, a closure variable or an object they hold
      (``LOSSES.append(loss)``): refused, and every change undone;
    * one kept in a plain attribute of a module (``self.cache = rotary``, as a module caches a value it
      derives from its input): undone, with a warning (the module computes it again the next time);
    * Python scalars assigned to attributes or variables (``self.calls += 1``, ``self._la_step = 0``,
      ``global STEP; STEP += 1``): kept, and assigned again after every run of the graph
      (:attr:`StateChange.replay`); returned, as functions of the call's hyperparameter values: a
      number computed from a float input (``self.last_lam = lam``) is assigned its value on that call
      (``scalars``);
    * any other change (``STATS["n"] += 1``, ``history.append(1.0)``): kept, with a warning that it
      happens only when the step is traced.

    A module whose class is library code (torch's RNN refreshing ``_flat_weights``, a HuggingFace model
    installing its hooks on the first call) gets the same treatment without the warnings: the user
    cannot change that code, and the changes are its own bookkeeping.

    Raises:
        TraceError: a tensor or size of the trace outlives it outside the model.
    """
    # Numbers of the hyperparameters only: replayed with each call's values, like Python scalars.
    changes = [
        dataclasses.replace(c, traced=False)
        if c.traced and c.assigned is not None and all(scalars.covers(v) for v in c.assigned.values()) else c
        for c in changes
    ]
    escaped = [c for c in changes if c.traced and not c.in_module]
    if escaped:
        for c in changes:
            c.undo()
        names = "; ".join(f"{c.description} ({c.detail})" for c in escaped)
        raise TraceError(
            f"the step keeps a tensor (or a size) it computed in Python state that outlives the call: "
            f"{names}. A compiled step's Python runs when it is traced, on tensors that exist only while "
            f"tracing, so this would hold a placeholder, once, instead of each step's value (nothing was "
            f"changed: the state is as before the call)\n"
            f"  fix: return the value from the step (`return loss, logits.detach()`) and keep what the "
            f"compiled step returns, after the call"
        )
    replays = []
    for c in changes:
        if c.replay is not None and not c.traced:
            if any(type(v) in _SymbolicScalars._TYPES for v in (c.assigned or {}).values()):
                replays.append(lambda values, replay=c.replay: replay(scalars.resolver(values)))
            else:  # Python scalars only (`self.calls += 1`): nothing to evaluate on each call
                replays.append(lambda values, replay=c.replay: replay())
        elif c.traced:
            c.undo()
            if c.in_library_module:  # torch's or a package's module (an RNN's _flat_weights): its business
                continue
            warnings.warn(
                f"spmd.compile: the step keeps a tensor (or a size) it computed in {c.description} "
                f"({c.detail}); those exist only while the step is traced, so the change was undone. To "
                f"keep a tensor across steps, register a buffer and assign it in the step (assigned "
                f"buffers are written back); to read one after the step, return it",
                stacklevel=3,
            )
        elif not c.in_library_module:
            warnings.warn(
                f"spmd.compile: the step changed {c.description} ({c.detail}) while it was traced; a "
                f"compiled step's Python code runs when it is traced (the first call and each "
                f"recompilation), not on every call: keep such bookkeeping outside the compiled step, or "
                f"in a buffer it updates",
                stacklevel=3,
            )
    return replays


def _write_back_assignments(held: dict[str, Any], params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Turn buffers the step *assigned* (``self.ema = 0.9 * self.ema + 0.1 * x.mean()``, or
    ``register_buffer`` again under the same name) into in-place writes of the buffer's graph input, so
    the value is written back like an in-place update (``running_mean.mul_(...)``) is. ``held`` maps
    each FQN to the tensor the module held when the step ended (torch's ``_reparametrize_module``
    writes it back). Without this the assignment went to a tensor that only existed while tracing:
    the model kept its old buffer, with no error.

    Raises:
        TraceError: a parameter was assigned (``self.weight = nn.Parameter(...)``), or a buffer was
            assigned something other than a tensor of its shape and dtype.
    """
    for fqn, before in params.items():
        if held.get(fqn, before) is not before:
            raise TraceError(
                f"the step assigns parameter {fqn} (a new tensor, not an in-place update): a compiled step "
                f"keeps the model's parameters; fix: update it in place (`with torch.no_grad(): "
                f"p.copy_(new)`), or replace it outside the compiled step"
            )
    for fqn, before in buffers.items():
        now = held.get(fqn, before)
        if now is before:
            continue
        if not isinstance(now, torch.Tensor) or now.dtype != before.dtype or now.shape != before.shape:
            shown = f"a {now.dtype} tensor of shape {tuple(now.shape)}" if isinstance(now, torch.Tensor) else type(now).__name__
            raise TraceError(
                f"the step assigns buffer {fqn} {shown}, where it is a {before.dtype} tensor of shape "
                f"{tuple(before.shape)}: a compiled step writes an assigned buffer back into the model's "
                f"buffer, so it must keep its dtype and shape; fix: assign a tensor of the same dtype and "
                f"shape (`.to(dtype)`), or change the buffer outside the compiled step"
            )
        with torch.no_grad():
            before.copy_(now)


# FakeTensorMode's refusal of a real tensor (torch/_subclasses/fake_tensor.py, allow_non_fake_inputs=False).
_NON_FAKE_INPUT = "Please convert all Tensors to FakeTensors first"


def _user_frame(e: BaseException) -> str:
    """The innermost frame of ``e``'s traceback outside torch and spmd_expand: ``file:line: source``."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not in_torch_or_spmd_expand(f.filename)]
    if not frames:
        return "<unknown source>"
    f = frames[-1]
    return f'File "{f.filename}", line {f.lineno}, in {f.name}: {(f.line or "").strip()}'


def _trace_failure_hint(kind: str, message: str, data_dependent: bool, library: str, source: str = "") -> str:
    """The fix for a step that failed to trace outside the optimizer: ``kind`` and ``message`` are the
    exception's, ``library`` is :func:`_library_frame`'s text (where in torch it failed, or ""),
    ``source`` the user's line (:func:`_user_frame`)."""
    if "generator=" in source and "SymIntArrayRef expected to contain only concrete integers" in message:
        # A draw from a torch.Generator of the user's, sized by the batch (symbolic while traced).
        return (
            "the line draws from a torch.Generator of your own (generator=...), which a compiled step cannot "
            "advance: the graph would keep a private copy of its state and draw the same numbers on every "
            "call; draw from the default generator (leave out generator=) and seed it alike on every rank "
            "with torch.manual_seed"
        )
    if data_dependent and "_detect_is_causal_mask" in library:
        # torch's examples pass generate_square_subsequent_mask(...) without is_causal.
        return (
            "nn.TransformerEncoder (or nn.Transformer) looks at the values of the mask it is given to find out "
            "whether it is causal; say so instead: pass is_causal=True along with the mask "
            "(nn.Transformer.generate_square_subsequent_mask(T)), and it reads no values"
        )
    if data_dependent and "grad_scaler.py" in library:
        return (
            "torch.amp.GradScaler.step() skips optimizer.step() when a gradient is inf/NaN, a branch on "
            "tensor values that one compiled graph cannot take; autocast to bfloat16 (no loss scaling "
            "needed) or scale the loss by a constant and divide the gradients by it before optimizer.step()"
        )
    if data_dependent and "torch/optim/swa_utils.py" in library:
        return (
            "torch.optim.swa_utils.AveragedModel.update_parameters() copies the parameters on its first call "
            "and averages after (a branch on its n_averaged tensor), which one compiled graph cannot take; call "
            "averaged.update_parameters(model) after the compiled step, or keep the average as buffers the step "
            "updates in place (`with torch.no_grad(): ema_p.lerp_(p, 1 - decay)`)"
        )
    if data_dependent and "torch/nn/utils/clip_grad.py" in library:
        return (
            "clip_grad_norm_(..., error_if_nonfinite=True) raises when the total norm is inf/NaN, a branch "
            "on tensor values that one compiled graph cannot take; pass error_if_nonfinite=False (the "
            "default) and check the norm the step returns after the call (`torch.isfinite(norm)`)"
        )
    if data_dependent and "torch/distributions/" in library:
        return (
            "torch.distributions checks its arguments' values when it builds a distribution (validate_args, on "
            "by default), a branch on tensor values; pass validate_args=False to the distribution, or call "
            "torch.distributions.Distribution.set_default_validate_args(False) once before the step"
        )
    if ("torch/nn/modules/rnn.py" in library or "torch/nn/utils/rnn.py" in library) and (
        data_dependent or "FakeTensor" in message
    ):
        return (
            "a PackedSequence (pack_padded_sequence) keeps its per-step batch sizes in a tensor that the RNN reads "
            "as Python ints, values a traced graph does not have; run the RNN on the padded batch and read each "
            "sequence's last real step (`out[torch.arange(len(lengths)), lengths - 1]`), or mask the padded steps"
        )
    if data_dependent and library:
        return (
            f"torch's code{library} reads a tensor's value (an argument check such as `if (var < 0).any(): "
            f"raise`, or a branch), which one graph cannot hold; write that computation out without the check, "
            f"or move it out of the step"
        )
    if data_dependent and "extract specialized" in message:
        # torch's GuardOnDataDependentSymNode when a value read into Python must become a plain int.
        return (
            "the step reads a tensor's value into Python and uses it as an int (`int(t)`, `range(t.item())`, or an "
            "index or slice bound: `x[t]` with a 0-d tensor `t`, `x[:t]`), a value one graph cannot hold; keep it "
            "a tensor: `x.index_select(dim, t.view(1))` or `torch.gather` for an index, a mask such as "
            "`x * (torch.arange(len(x)) < t)` for a slice, or move that code out of the step"
        )
    op = re.match(r"(aten\.\w+\.\w+)", message)
    if data_dependent and kind == "DataDependentOutputException" and op and op.group(1) != "aten._local_scalar_dense.default":
        # An ATen op whose result is a Python value of tensor values: torch.cov's and corrcoef's
        # argument check calls aten.equal.
        return (
            f"{op.group(1)} returns a Python value computed from tensor values (an argument check inside a "
            f"torch function, as torch.cov and torch.corrcoef make), which one graph cannot hold; write that "
            f"computation out with tensor ops (the covariance of rows x: `xc = x - x.mean(0); xc.T @ xc / "
            f"(len(x) - 1)`), or move it out of the step"
        )
    if data_dependent:
        return "the step branches on tensor values (data-dependent control flow); compute the branch with torch.where or move it out of the step"
    if kind == "UnsupportedOperatorException" and op:
        return (
            f"torch has no fake-tensor (meta) implementation of {op.group(1)}, so a trace cannot run it (the step "
            f"itself runs eagerly); compute its result outside the step and pass it in as a tensor argument, or "
            f"use ops that have one (a draw of a fixed shape, or of a 0-d parameter, may take another path)"
        )
    if "backward through spmd_expand.gradient" in message:
        # The marker of a gradient read after backward() has no autograd formula: p.grad of a
        # backward(create_graph=True) differentiated again.
        return (
            "the step differentiates a gradient that backward(create_graph=True) wrote into .grad (a gradient "
            "penalty), which the compiled step reads as data; compute it with torch.autograd.grad(loss, params, "
            "create_graph=True) and differentiate what that returns (supported), then backward() the total"
        )
    attribute = re.search(r"'(FakeTensor|FunctionalTensor|Tensor|Parameter)' object has no attribute '(\w+)'", message)
    if kind == "AttributeError" and attribute:
        return (
            f"the step reads attribute {attribute.group(2)!r} of a tensor: one you set on a parameter or tensor "
            f"(`p.{attribute.group(2)} = ...`) is not carried into the trace, which runs the step on stand-in "
            f"tensors (nor onto the DTensor a parameter becomes). Keep per-parameter settings outside the tensor: "
            f"in a dict keyed by the parameter's name (`model.named_parameters()`), or in the optimizer's param "
            f"groups (one group per setting)"
        )
    if kind == "DynamicOutputShapeException":
        op = message.splitlines()[0] if message else "an op"
        return (
            f"the output shape of {op} depends on the values of its tensor arguments (torch's fake tensors "
            f"cannot know it before running, as for F.ctc_loss), so it cannot be part of a traced graph; keep "
            f"that op out of the compiled step"
        )
    # A shape symbol (`s53` in "size of tensor a (s53)"), not a path component such as /runs/s52/.
    symbol = re.search(r"(?<![\w/\\.])s\d+(?![\w/\\.])", message)
    if symbol:
        return (
            f"a size of the global batch (a batch tensor's plan batch dim, traced as the symbol {symbol.group()}) "
            f"met another tensor's fixed size: some argument of the step does not hold its samples on the plan's "
            f"batch_dim (0 unless set), e.g. sequence-first data (seq, batch, ...) beside per-sample targets, or a "
            f"tensor that is not part of the batch (class weights). Make batch_dim the samples' dim of every batch "
            f"tensor (spmd.DDP(batch_dim=1) when inputs and targets are all sequence-first), or pass batch-first "
            f"tensors and transpose them inside the step, and register other tensors on the model "
            f"(`model.register_buffer(name, tensor)`)"
        )
    return "make sure the step runs eagerly on one device first; see the chained exception"


def _library_frame(e: BaseException) -> str:
    """``", inside torch's <module>.<function>"`` for the innermost frame of ``e``'s traceback below the
    user's innermost frame that is torch code outside its tracing machinery (e.g.
    ``torch/amp/grad_scaler.py`` in ``_maybe_opt_step``), or ``""``."""
    frames = list(traceback.extract_tb(e.__traceback__))
    user = [i for i, f in enumerate(frames) if not in_torch_or_spmd_expand(f.filename)]
    below = frames[user[-1] + 1:] if user else []
    tracing = ("/torch/fx/", "/torch/_subclasses/", "/torch/_ops.py", "/torch/utils/", "/torch/_prims", "/torch/_refs",
               "/torch/_decomp", "/torch/_meta_registrations", "/torch/_library", "/torch/_compile", "/torch/_dynamo",
               "/torch/_tensor.py", "/torch/overrides.py", "/torch/__init__.py", "/torch/_guards.py")
    shown = [(f.filename.replace("\\", "/"), f.name) for f in below]
    shown = [(path, name) for path, name in shown if "/torch/" in path and not any(t in path for t in tracing)]
    if not shown:
        return ""
    path, name = shown[-1]
    return f", inside torch/{path.split('/torch/', 1)[1]} in {name}"


def _raised_in_optimizer(e: BaseException) -> bool:
    """Whether ``e`` was raised inside ``Optimizer.step()``: below the user's innermost frame there are
    only torch's and spmd_expand's own frames (tracing hooks), and among them the step wrappers of
    ``torch/optim/optimizer.py`` (every ``torch.optim`` optimizer's ``step`` runs through them; other
    code of ``torch.optim``, such as ``swa_utils.AveragedModel.update_parameters``, does not)."""
    files = [f.filename.replace("\\", "/") for f in traceback.extract_tb(e.__traceback__)]
    user = [i for i, f in enumerate(files) if not in_torch_or_spmd_expand(f)]
    below = files[user[-1] + 1:] if user else files
    return any(f.endswith("/torch/optim/optimizer.py") for f in below)


def _optimizer_hint(optimizer: torch.optim.Optimizer, data_dependent: bool) -> str:
    """The fix for an optimizer whose code path cannot be traced (torch 2.13's optimizers: RAdam's and
    ASGD's default paths branch on their step and ``mu`` values; Adamax's foreach path passes a list
    of tensors where its fused op takes numbers)."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if any(g.get("differentiable") for g in groups):
        return (
            f"construct {name} with differentiable=False (the default): with differentiable=True its step "
            f"updates the parameters in place with autograd recording, which the compiled step cannot trace "
            f"(a leaf that requires grad written in place); to differentiate through an update (meta-learning), "
            f"compute the updated weights out of place and call the model with them "
            f"(torch.func.functional_call)"
        )
    if data_dependent:
        capturable = (
            "construct it with capturable=True (its branch-free path, for parameters on CUDA/XPU/HPU), or "
            if "capturable" in optimizer.defaults
            else ""
        )
        others = ", ".join(n for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "Rprop", "Adamax") if n != name)
        return (
            f"{name}'s default code path branches on the value of an optimizer state (e.g. its step count), "
            f"which one compiled graph cannot do for every step; {capturable}use an optimizer whose default "
            f"path has no such branch ({others} with foreach=False)"
        )
    if any(g.get("foreach") is not False for g in groups):
        return (
            f"if {name} ran its foreach path (foreach=True, the default on CUDA), construct it with "
            f"foreach=False (its single-tensor path); see the chained exception"
        )
    return "see the chained exception; the optimizer's step must run eagerly on one device first"


def _refuse_writes_to_parameter_reads(gm: fx.GraphModule) -> None:
    """Refuse an in-place op on the value a function was handed for a parameter.

    A parameter passed to a torch function is handed over as its ``unshard`` read (what FSDP gathers).
    A function that writes into that argument (or a view of it) in place, such as ``F.embedding`` with ``max_norm``
    (``embedding_renorm_`` on the weight it was given), would change the read, not the parameter: the
    write would be lost for later steps, silently. An in-place op called on the parameter itself
    (``weight.mul_(...)``, ``torch.embedding_renorm_(emb.weight, ...)``) writes the parameter and is fine.

    Raises:
        TraceError: naming the op, the parameter, the user's line and the fix.
    """
    for node in gm.graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable or not node.args:
            continue
        first = node.args[0]
        # Through views of the read (detach, t, slices, ...): they share its storage.
        while isinstance(first, fx.Node) and isinstance(first.target, torch._ops.OpOverload) and first.target.is_view:
            first = first.args[0]
        if isinstance(first, fx.Node) and first.target is ops.UNSHARD and target._schema.arguments[0].is_write:
            fqn = first.args[1]
            fix = (
                "nn.Embedding(max_norm=...) renormalizes inside F.embedding, on the value it is handed; renormalize "
                "explicitly before the lookup, on the parameter itself: "
                "`with torch.no_grad(): torch.embedding_renorm_(emb.weight, ids, max_norm, norm_type)`, "
                "and build the nn.Embedding without max_norm"
                if target is torch.ops.aten.embedding_renorm_.default
                else "write to the parameter itself (e.g. `module.weight.mul_(...)` under torch.no_grad()), not to "
                "the value a function was handed for it"
            )
            raise node_error(
                TraceError,
                node,
                f"{target} writes in place into the value read for parameter {fqn!r}, not into the parameter: the "
                f"change would be lost after this step",
                fix=fix,
            )


_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})


def _refuse_collectives(gm: fx.GraphModule) -> None:
    """Refuse a collective the step calls itself (``dist.all_reduce(loss)`` to log a global loss,
    carried over from a DDP script): the step is written for one device, where its values already are
    global; spmd_expand adds every collective the plan needs. Left in, it would reduce a global value
    again (W times the loss).

    Raises:
        TraceError: naming the collective, the user's line and the fix.
    """
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in _COLLECTIVE_NAMESPACES:
            raise node_error(
                TraceError,
                node,
                f"the step calls a collective itself ({node.target}): a compiled step is written for one device, "
                f"where the loss and every other value it computes already cover the global batch; spmd_expand "
                f"inserts the collectives the plan needs",
                fix="remove the torch.distributed call from the step (the loss the step returns is the global "
                "value: e.g. log it on rank 0 after the call)",
            )


def _refuse_storage_swaps(gm: fx.GraphModule) -> None:
    """Refuse ``Tensor.set_`` (a tensor made to alias another's storage): functionalization does not
    carry it to the graph's outputs, so a parameter ``set_`` to its update would silently keep its old
    values. (``.data =`` becomes an in-place copy instead: :func:`_assign_data`.)

    Raises:
        TraceError: naming the node, the user's line and the fix.
    """
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket is torch.ops.aten.set_:
            raise node_error(
                TraceError,
                node,
                "Tensor.set_ makes a tensor alias another's storage, which a compiled step cannot record (the "
                "tensor would keep its old values)",
                fix="copy the values in place: `with torch.no_grad(): p.copy_(value)`",
            )


def _refuse_recomputed_draws(gm: fx.GraphModule) -> None:
    """Refuse a random draw inside backward: activation checkpointing re-running a random op.

    ``torch.utils.checkpoint`` replays the forward's draws by restoring the generator state
    (``preserve_rng_state``) in Python, which a traced graph does not record: the recompute would
    draw new values (another dropout mask than forward's) and the gradients would be wrong.

    Raises:
        TraceError: naming the op, the node, the module and the fix.
    """
    from .rng import draws_random

    for node in gm.graph.nodes:
        if backward_index(node) is not None and draws_random(node):
            drawn = [n for n in gm.graph.nodes if n.target is node.target and backward_index(n) is None]
            where = f" (forward draws it at {user_source_line(drawn[0])})" if drawn else ""
            raise node_error(
                TraceError,
                node,
                f"backward re-runs the random op {node.target}{where}: activation checkpointing recomputes it, "
                f"and the recomputed draw would differ from forward's (the generator state that checkpoint "
                f"restores is not part of a traced graph)",
                fix="save the random op's output instead of recomputing it: checkpoint(..., use_reentrant=False, "
                "context_fn=functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, "
                "[torch.ops.aten.native_dropout.default, ...])), or call dropout outside the checkpointed function",
            )


def _widen_scalar_states(by_role, states, real_params, fqns) -> list:
    """Give the optimizer float64 copies of its 0-d float32 bookkeeping states (Adam's ``step``,
    NAdam's ``mu_product``) while tracing.

    The eager default path reads them with ``.item()`` into Python floats and computes bias
    corrections in double precision; traced, they stay tensors, and in float32 the update would
    round differently (up to 2.4e-5 after 5 Adam steps of a 10-layer MLP at lr 1e-2). The copies are
    written back into the float32 states after the step. Returns (state, copy, fqn, key) tuples.

    A 0-d *parameter* (a learnable temperature, CLIP's ``logit_scale``) also has 0-d elementwise
    states (``exp_avg``), which the update combines with its float32 gradient and must stay float32:
    for it, only keys that are 0-d for some parameter that is not (``step``, when every parameter is
    0-d) are bookkeeping.
    """
    scalar_keys = {
        role.key
        for role, t in by_role.items()
        if role.kind == "state" and t.dim() == 0 and real_params[role.fqn].dim() > 0
    } or {"step"}
    widened = []
    for role, t in by_role.items():
        # Every 0-d key of a parameter that is not 0-d is in scalar_keys.
        if role.kind == "state" and role.fqn in fqns and t.dim() == 0 and t.dtype == torch.float32 and role.key in scalar_keys:
            wide = t.to(torch.float64)
            states[id(real_params[role.fqn])][role.key] = wide
            widened.append((t, wide, role.fqn, role.key))
    return widened


def _hyperparameter_guards(
    shape_env: ShapeEnv, symbols: list[sympy.Symbol], hyperparameters: list, hints: list[float]
) -> HyperParameterGuards:
    """The shape env's guards that mention hyperparameter symbols, other symbols bound to their hints.

    Size symbols are fixed by the cache key (shapes are part of it), so only hyperparameters vary.
    """
    names = {sym: str(hp) for sym, hp in zip(symbols, hyperparameters)}
    sizes = {s: v for s, v in shape_env.backed_var_to_val.items() if s not in names}
    conditions, sources = [], []
    for guard in shape_env.guards:
        if not guard.expr.free_symbols & names.keys():
            continue
        condition = guard.expr.xreplace(sizes)
        conditions.append(condition)
        sources.append(str(condition.xreplace({s: sympy.Symbol(n) for s, n in names.items()})))
    return HyperParameterGuards(symbols, conditions, sources, list(hints), [str(hp) for hp in hyperparameters])


def _drop_profiler_nodes(gm: fx.GraphModule) -> None:
    """Remove the optimizer's record_function markers, which carry no data."""
    for node in reversed(list(gm.graph.nodes)):
        if _is_profiler_node(node):
            gm.graph.erase_node(node)  # exit markers come after (and are erased before) their enter
