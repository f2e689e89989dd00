"""Trace a whole train step (forward, backward, optimizer) into one functional global graph.

The step is traced twice, both times with ``make_fx`` on fake tensors that have the *global* shapes:

1. with autograd, so ``loss.backward()`` records the backward ops and ``optimizer.step()`` records the
   update (in-place ops included). Batch dims are symbolic, so sizes the step reads from its batch
   appear as ``sym_size`` nodes (DSymInt sources for propagation);
2. through ``torch.func.functionalize`` over an fx Interpreter of graph 1, which removes mutation:
   updated parameters, buffers, optimizer states and gradients become ``aten.copy_`` into their
   placeholders at the end of the graph (what AOTAutograd does for input mutations).

The graph's placeholders follow :attr:`TracedStep.inputs` and its outputs :attr:`TracedStep.outputs`.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.nn.utils import stateless
from torch.overrides import TorchFunctionMode

from . import ops
from .boundaries import mark_boundaries
from .errors import TraceError
from .loss_parallel import MarkLossParallel

__all__ = ["InputRole", "OutputRole", "TracedStep", "TensorSpec", "trace_step"]

aten = torch.ops.aten


@dataclass(frozen=True)
class InputRole:
    """What a graph placeholder is: ``kind`` in {param, buffer, grad, state, batch}.

    ``fqn`` names the parameter or buffer (for grad/state: the parameter); ``key`` is the optimizer
    state key (``"exp_avg"``) or, for batch tensors, the index of the leaf among the step's tensor args.
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


# In-place fused optimizer ops whose C++ functionalization kernel cannot handle their list arguments
# in torch 2.13; the functional variant returns the updated lists, which are copied back instead.
_FUNCTIONAL_VARIANT = {
    aten._fused_adam_.default: (aten._fused_adam.default, (0, 1, 2, 3, 4)),
    aten._fused_adamw_.default: (aten._fused_adamw.default, (0, 1, 2, 3, 4)),
    aten._fused_sgd_.default: (aten._fused_sgd.default, (0, 1, 2)),
}


def _nll_loss_mean_as_sum(self, target, weight, reduction, ignore_index):
    """``nll_loss_forward`` with ``reduction="mean"`` as ``sum / total_weight`` (same values).

    DTensor's rule for the mean form averages per-rank means (``Partial(avg)``), which is wrong when
    ranks ignore different numbers of targets; as a sum and a total weight, both are reduced before
    the division, so the mean is over the global batch.
    """
    if reduction != 1:  # torch._reduction: 0 none, 1 mean, 2 sum
        return NotImplemented
    total, total_weight = aten.nll_loss_forward.default(self, target, weight, 2, ignore_index)
    return total / total_weight, total_weight


# Applied while functionalizing (pass 2): rewrites that keep single-device values and give the
# sharded program the global semantics.
_DECOMPOSITIONS = {aten.nll_loss_forward.default: _nll_loss_mean_as_sum}


class _FunctionalizingInterpreter(fx.Interpreter):
    """Runs graph 1 under functionalize, swapping fused in-place optimizer ops for functional ones."""

    def call_function(self, target, args, kwargs):
        if target in _FUNCTIONAL_VARIANT:
            functional, mutated = _FUNCTIONAL_VARIANT[target]
            results = functional(*args, **kwargs)
            for arg_index, new_values in zip(mutated, results):
                for dst, src in zip(args[arg_index], new_values):
                    dst.copy_(src)
            return None
        return super().call_function(target, args, kwargs)


@contextlib.contextmanager
def _optimizer_on(
    optimizer: Optional[torch.optim.Optimizer],
    swap: dict[int, torch.Tensor],
    states: dict[int, dict[str, Any]],
    fqn_of: dict[int, str],
) -> Iterator[None]:
    """Point ``optimizer`` at the traced parameters and states while the step is traced.

    Also (a) switches param groups to the capturable code path, which keeps ``step`` a tensor instead
    of reading it into a Python float that would be baked into the graph, and (b) marks each gradient
    with :func:`spmd_expand.ops.gradient` right before the update reads it.
    """
    if optimizer is None:
        yield
        return
    saved_params = [g["params"] for g in optimizer.param_groups]
    saved_capturable = [g.get("capturable") for g in optimizer.param_groups]
    saved_state = optimizer.state
    traced_state: collections.defaultdict = collections.defaultdict(dict)
    for group in optimizer.param_groups:
        group["params"] = [swap[id(p)] for p in group["params"]]
        if "capturable" in group:
            group["capturable"] = True
    for pid, st in states.items():
        traced_state[swap[pid]] = st
    optimizer.state = traced_state
    fqn_by_traced = {id(swap[pid]): fqn for pid, fqn in fqn_of.items()}

    def mark_gradients(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = ops.gradient(p.grad, fqn_by_traced[id(p)])

    handle = optimizer.register_step_pre_hook(mark_gradients)
    try:
        yield
    finally:
        handle.remove()
        optimizer.state = saved_state
        for group, params, cap in zip(optimizer.param_groups, saved_params, saved_capturable):
            group["params"] = params
            if cap is not None:
                group["capturable"] = cap


BACKWARD_KEY = "spmd_backward"


def backward_index(node: fx.Node) -> Optional[int]:
    """1-based index of the ``backward()`` call that created ``node``; None outside backward."""
    return (node.meta.get("custom") or {}).get(BACKWARD_KEY)


class _MarkBackward(TorchFunctionMode):
    """Tags every node recorded inside a ``backward()`` call with that call's index.

    Needs ``fx_traceback.preserve_node_meta()``; the tag is ``node.meta["custom"]["spmd_backward"]``
    and survives functionalization. Later stages use it to tell forward from backward uses.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            self.calls += 1
            with fx_traceback.annotate({BACKWARD_KEY: self.calls}):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _fake(fake_mode: FakeTensorMode, spec: TensorSpec) -> torch.Tensor:
    # Only metadata is read; on CPU untouched pages of an empty tensor cost no memory.
    template = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
    context = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in spec.dynamic_dims else DimDynamic.STATIC for d in range(len(spec.shape))]
    )
    return fake_mode.from_tensor(template, symbolic_context=context)


def trace_step(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    input_roles: list[InputRole],
    input_specs: list[TensorSpec],
    module_layouts: Optional[Mapping[str, list]] = None,
) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` into a functional global graph.

    Args:
        fn: the user's train step; ``model`` and ``optimizer`` appear among ``args``/``kwargs``.
        module_layouts: module FQN -> [(mesh dim, :class:`~spmd_expand.boundaries.BoundaryLayouts`)]:
            where ``layout`` markers go (tensor-parallel module boundaries).
        input_roles / input_specs: one entry per graph input, with global shapes. Batch inputs
            (``kind == "batch"``, ``key`` = index among the tensor leaves of ``(args, kwargs)``) take
            the place of those leaves; param/buffer/grad/state inputs replace the model's and
            optimizer's tensors.

    Returns:
        A :class:`TracedStep`. New optimizer states and gradients left set by the step are outputs;
        mutated inputs are ``aten.copy_`` nodes into their placeholders.

    Raises:
        TraceError: the step has data-dependent control flow, returns non-tensors, or fails to trace.
    """
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    fakes = [_fake(fake_mode, s) for s in input_specs]
    leaves, tree = pytree.tree_flatten((args, kwargs))
    tensor_leaf_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    real_params = dict(model.named_parameters())
    fqn_of = {id(p): fqn for fqn, p in real_params.items()}
    outputs: list[OutputRole] = []
    cleared_grads: list[str] = []
    return_spec: list[tuple[pytree.TreeSpec, list[bool]]] = []

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        by_role = dict(zip(input_roles, flat))
        params = {r.fqn: nn.Parameter(t, requires_grad=real_params[r.fqn].requires_grad) for r, t in by_role.items() if r.kind == "param"}
        buffers = {r.fqn: t for r, t in by_role.items() if r.kind == "buffer"}
        swap = {id(real_params[fqn]): p for fqn, p in params.items()}
        states: dict[int, dict[str, Any]] = {}
        if optimizer is not None:
            for p, st in optimizer.state.items():
                # Non-tensor state (e.g. SGD's momentum_buffer=None) is carried over as is.
                states[id(p)] = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        for r, t in by_role.items():
            if r.kind == "state":
                states.setdefault(id(real_params[r.fqn]), {})[r.key] = t
            elif r.kind == "grad":
                params[r.fqn].grad = t
        inputs_by_id = {id(t): r for r, t in by_role.items()}

        batch = {int(r.key): t for r, t in by_role.items() if r.kind == "batch"}
        new_leaves = list(leaves)
        for i, pos in enumerate(tensor_leaf_positions):
            new_leaves[pos] = batch[i]
        call_args, call_kwargs = pytree.tree_unflatten(new_leaves, tree)

        # The module reads each parameter through an `unshard` marker; the optimizer updates the
        # stored parameter itself.
        used = {fqn: ops.unshard(p, fqn) for fqn, p in params.items()}
        with stateless._reparametrize_module(model, {**used, **buffers}, tie_weights=True), _optimizer_on(
            optimizer, swap, states, fqn_of
        ), mark_boundaries(model, module_layouts or {}):
            result = fn(*call_args, **call_kwargs)
            traced_states = {fqn: optimizer.state.get(params[fqn], {}) for fqn in params} if optimizer else {}

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
        for fqn, p in params.items():
            if p.grad is not None and inputs_by_id.get(id(p.grad)) != InputRole("grad", fqn):
                outputs.append(OutputRole("grad", fqn))
                # Marking twice (step pre-hook, then here) is harmless: the second is an identity.
                out.append(ops.gradient(p.grad, fqn))
        return out

    try:
        with torch.compiler._compile_session_context(), torch.enable_grad():
            # _compile_session_context: optimizers take their traceable paths (tensor `step`, no .item()).
            with fx_traceback.preserve_node_meta(), _MarkBackward(), MarkLossParallel():
                autograd_graph = make_fx(step, tracing_mode="symbolic", record_stack_traces=True)(*fakes)
            detached = [t.detach() for t in fakes]

            def replay(*flat: torch.Tensor) -> list[torch.Tensor]:
                with torch.no_grad(), fx_traceback.preserve_node_meta():
                    return _FunctionalizingInterpreter(autograd_graph).run(*flat)

            functional = make_fx(
                torch.func.functionalize(replay, remove="mutations"),
                decomposition_table=_DECOMPOSITIONS,
                tracing_mode="symbolic",
            )(*detached)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes one clear error
        kind = type(e).__name__
        hint = (
            "the step branches on tensor values (data-dependent control flow); compute the branch "
            "with torch.where or move it out of the step"
            if "DataDependent" in kind or "data-dependent" in str(e).lower() or "GuardOnDataDependent" in kind
            else "make sure the step runs eagerly on one device first; see the chained exception"
        )
        raise TraceError(f"could not trace the train step: {kind}: {str(e).splitlines()[0] if str(e) else ''}\n  fix: {hint}") from e

    functional.graph.eliminate_dead_code()
    _drop_profiler_nodes(functional)
    functional.recompile()
    spec, is_tensor = return_spec[-1]
    return TracedStep(
        functional, list(input_roles), list(outputs), list(input_specs), spec, is_tensor, list(cleared_grads), fake_mode
    )


def _drop_profiler_nodes(gm: fx.GraphModule) -> None:
    """Remove the optimizer's record_function markers, which carry no data."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "profiler":
            gm.graph.erase_node(node)  # exit markers come after (and are erased before) their enter
