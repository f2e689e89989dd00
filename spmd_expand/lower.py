"""Lower the expanded per-rank graph to something runnable: Inductor code, or the fx graph as is."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import unittest.mock
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from .errors import SpmdError
from .frame_stack import frame_stack_headroom
from .graph_stats import COLLECTIVES
from .passes.manager import copy_graph_module
from .passes.feeders import WAIT
from .rng import draws_random
from .tensorify import tensorify_float_inputs
from .watch import watch_collectives

__all__ = ["LOWERINGS", "CollectiveHazard", "collective_hazard", "lower"]

log = logging.getLogger(__name__)

LOWERINGS = ("inductor", "eager")


_OUR_COMM_PASSES = frozenset({"bucketing", "overlap"})


def _keep_issue_order_pass(chained: Any) -> Any:
    """An Inductor post-grad pass (``config.post_grad_custom_post_pass``) that keeps each collective
    issued where the ``overlap`` pass put it.

    Inductor's scheduler fuses kernels that read the same buffers and places a fused kernel where its
    last part had to be: the loss denominator (the count of targets not ignored, which ``overlap``
    issues at the top of the graph) was fused into the loss kernel at the end of the forward, so its
    all-reduce was issued after the forward after all. Each collective start is made an ordering
    dependency of the first compute node after it, with torch's own ``control_deps`` mechanism
    (``torch._inductor.fx_passes.control_dependencies.preserve_node_ordering``, what Inductor uses to
    keep random ops in program order); a fusion across it would be a cycle, so Inductor leaves it.
    ``chained``: a post-grad pass the user configured, run afterwards.

    Installed for graphs on an accelerator only (:func:`_lower`), where a collective runs beside the
    compute kernels (NCCL). On CPU ranks gloo's communication needs a core the compute also uses, so an
    early issue hides nothing: on the demo GPT's DDP step (2 gloo ranks, 2 cores) the pass measured
    1.3-1.5% slower in two A/B runs (11.8 vs 11.6 ms, 150 interleaved rounds), within the spread of such
    A/B runs on that machine (``bench/pass_ab.py``: up to 10%), and no faster.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    def _computes(node: fx.Node) -> bool:
        """A functional ATen op that makes a kernel: not a collective, a wait, a view, an in-place op
        or an ordering node."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target in COLLECTIVES or target is WAIT:
            return False
        returns = target._schema.returns
        return not target._schema.is_mutable and not (returns and returns[0].alias_info is not None)

    class KeepCollectiveIssueOrder(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            deps: dict = {}
            for start in [n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]:
                node = start.next
                while node.op == "call_function" and not _computes(node):
                    node = node.next
                if node.op == "call_function" and start not in node.all_input_nodes:
                    deps.setdefault(node, OrderedSet()).add(start)
            preserve_node_ordering(graph, deps)
            if chained is not None:
                chained(graph)

        def uuid(self) -> Any:
            return (get_hash_for_files((__file__,)), chained.uuid() if chained is not None else None)

    return KeepCollectiveIssueOrder()


@frame_stack_headroom
def lower(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    mode: str,
    ran_passes: frozenset = frozenset(),
    mesh: Optional[DeviceMesh] = None,
) -> Callable[..., list]:
    """Compile ``gm`` for ``example_inputs`` (this rank's local tensors).

    ``"inductor"`` runs ``torch._inductor.compile_fx.compile_fx`` (C++/OpenMP on CPU, Triton on CUDA);
    functional collectives in the graph are lowered by Inductor and run on the default process group.
    ``"eager"`` returns ``gm`` itself. Both mutate parameter/state inputs in place (their ``copy_``).

    Inductor normally replaces random ops by its own generator (Philox-style seeds it draws once per
    call), whose values differ from ATen's; the single-device promise needs ATen's draws, so a graph
    that draws random numbers is compiled with ``torch._inductor.config.fallback_random`` set for this
    compilation only. Inductor then calls the ATen ops and keeps them in program order.

    When our ``bucketing`` or ``overlap`` pass ran (``ran_passes`` names the passes that ran),
    Inductor's own collective bucketing and compute/communication reordering stay off (they are off
    by default in torch 2.13; set explicitly so a user's global Inductor config cannot make them run
    twice), and so does its peak-memory reordering, which would move the collectives back.

    Either way the result is wrapped by :func:`~spmd_expand.watch.watch_collectives`: a collective that
    fails or times out raises :class:`~spmd_expand.errors.CollectiveError` naming its node (and its
    mesh dim of ``mesh``).

    Raises:
        SpmdError: an unknown ``mode``.
    """
    return watch_collectives(gm, _lower(gm, example_inputs, mode, ran_passes), mesh)


def _without_torch_tensorify() -> contextlib.AbstractContextManager:
    """Switch off torch's ``tensorify_python_scalars`` pass, which AOTAutograd runs on every graph.

    It is Dynamo's ``specialize_float=False`` machinery: it turns Dynamo's symbolic float inputs into
    tensors and, where it cannot, raises ``TensorifyScalarRestartAnalysis`` for Dynamo to trace again
    with the float specialized. Our graphs have no such inputs (:mod:`spmd_expand.tensorify` did that
    job), nobody can restart them, and with a BatchNorm in the graph the pass raised anyway (backed
    float symbols in the shape env). torch reads its switch, the ``TENSORIFY_PYTHON_SCALARS``
    environment variable, on each graph."""
    return unittest.mock.patch.dict(os.environ, {"TENSORIFY_PYTHON_SCALARS": "0"})


def _cacheable(example_inputs: Sequence[Any]):
    """A tracing context whose fake mode has a ``ShapeEnv``: Inductor's FX graph cache (on by default)
    bypasses a graph compiled without one ("No shape env"), so each process compiled every graph again.

    Our graphs are specialized to this rank's local sizes, so every input is registered with static
    sizes. ``static_shapes=True`` on the fake mode is not enough: AOTAutograd fakifies the example
    inputs with ``from_tensor(static_shapes=False)`` unless the tracing context holds a symbolic
    context for the tensor, so every size became a symbol. Inductor then compiled size-generic
    kernels, and a BatchNorm's unbiased-variance factor ``n / (n - 1)`` became a symbolic float that
    torch's ``tensorify_python_scalars`` pass could not place ("KeyError: s18"): a ResNet step
    under DDP stopped in Inductor.
    """
    from torch._dynamo.source import LocalSource
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatefulSymbolicContext

    context = TracingContext(FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            context.tensor_to_context[x] = StatefulSymbolicContext(
                dynamic_sizes=[DimDynamic.STATIC] * x.dim(), tensor_source=LocalSource(f"arg{i}")
            )
    return tracing(context)


@contextlib.contextmanager
def _generated_wrappers():
    """Yields a list filled, on exit, with the source of every Python module Inductor loads inside
    (its generated wrapper code, compiled or taken from its caches, in memory or on disk)."""
    from torch._inductor.codecache import PyCodeCache

    paths: list[str] = []
    load = PyCodeCache.load_by_key_path.__func__

    def recording(cls, key, path, *args, **kwargs):
        paths.append(path)
        return load(cls, key, path, *args, **kwargs)

    sources: list[str] = []
    with unittest.mock.patch.object(PyCodeCache, "load_by_key_path", classmethod(recording)):
        yield sources
    for path in dict.fromkeys(paths):
        if os.path.exists(path):
            with open(path) as f:
                sources.append(f.read())


_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)\s*$")
_ASSIGNED = re.compile(r"^\s*(buf\d+) = ")
_OUT = re.compile(r"\bout=(buf\d+)")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((?:reinterpret_tensor\()?(buf\d+)\b")
_ALIAS = re.compile(r"^\s*(buf\d+) = (?:reinterpret_tensor\((buf\d+)\b.*# alias|(buf\d+)\[\d+\])\s*$")
_REUSE = re.compile(r"^\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*# reuse\s*$")
_BUFFER = re.compile(r"\bbuf\d+\b")


@dataclass(frozen=True)
class CollectiveHazard:
    """A line of Inductor's wrapper code that uses a collective's memory while gloo still uses it
    (from its own thread, until the ``wait_tensor``): ``kind`` ``"read"``, a read of the collective's
    output (or a view of it), which holds its data only once waited; ``"overwrite"``, the collective's
    input buffer (or a buffer it is a view of) handed to another value (``bufN = bufM  # reuse``),
    which the next kernel writes while the collective is still sending it."""

    kind: str
    buffer: str
    collective: str
    line: str

    def __str__(self) -> str:
        role = "output" if self.kind == "read" else "input"
        what = "reads" if self.kind == "read" else "reuses the memory of"
        return f"{what} {self.buffer} (the {role} of {self.collective}) before its wait, in `{self.line[:160]}`"


def collective_hazard(source: str) -> Optional[CollectiveHazard]:
    """The first :class:`CollectiveHazard` in Inductor's wrapper code ``source``, or None where every
    collective's output is read and its input's memory reused only after its ``wait_tensor``.

    Shape asserts, comments, ``del`` and views are not reads. Collectives are the
    ``torch.ops._c10d_functional`` calls: a result assigned (``bufN = all_gather_into_tensor(...)``),
    written to ``out=`` (the ``_out`` forms torch's bucketing merges into) or in place (``all_reduce_``).
    """
    pending: dict[str, tuple[str, int]] = {}  # output buffer (or a view of it) -> (collective, call)
    sending: dict[str, tuple[str, int]] = {}  # input buffer (and what it is a view of) -> (collective, call)
    base: dict[str, str] = {}  # a view -> the buffer it is a view of
    for number, line in enumerate(source.splitlines()):
        stripped = line.strip()
        wait = _WAIT.search(line)
        if wait:
            _, call = pending.pop(wait.group(1), ("", -1))
            if all(c != call for _, c in pending.values()):
                sending = {b: v for b, v in sending.items() if v[1] != call}
            continue
        issued = _CALL.search(line)
        if issued:
            name, arguments = issued.groups()
            inputs = _BUFFER.findall(arguments.split("out=")[0])
            outputs = [m.group(1) for m in (_ASSIGNED.match(line), _OUT.search(arguments)) if m]
            if name.endswith("_"):  # in place: its inputs are its outputs
                outputs += inputs
            for b in outputs:
                pending[b] = (name, number)
            for b in inputs if not name.endswith("_") else ():
                while b is not None:
                    sending[b] = (name, number)
                    b = base.get(b)
            continue
        if stripped.startswith(("assert_size_stride(", "assert_alignment(", "#", "del ")):
            continue
        alias = _ALIAS.match(line)
        if alias:
            base[alias.group(1)] = alias.group(2) or alias.group(3)
            if base[alias.group(1)] in pending:
                pending[alias.group(1)] = pending[base[alias.group(1)]]
            continue
        reuse = _REUSE.match(line)
        if reuse and reuse.group(2) in sending:
            return CollectiveHazard("overwrite", reuse.group(2), sending[reuse.group(2)][0], stripped)
        read = next((b for b in _BUFFER.findall(line) if b in pending), None)
        if read is not None:
            return CollectiveHazard("read", read, pending[read][0], stripped)
    return None


# Inductor's buffer planning without reuse: each buffer its own memory, so no collective's input is
# handed to another value while it is in flight (see InductorStep).
_NO_BUFFER_REUSE = {"allow_buffer_reuse": False, "inplace_buffers": False}


class InductorStep:
    """``gm`` compiled by Inductor (``compile_fx``), called like ``gm``.

    Float inputs (the optimizer's hyperparameters, the step's float arguments, the floats it reads from
    globals) must stay inputs, and Inductor would compile them
    in as constants (:mod:`spmd_expand.tensorify`). They are passed as 0-d float64 tensors where
    :func:`~spmd_expand.tensorify.tensorify_float_inputs` could rewrite their uses; otherwise they stay
    constants, and a call with other values compiles ``gm`` again for them (with a warning; the last
    ``_KEEP`` compilations are kept), so that no call runs with a stale value.
    """

    _KEEP = 8

    def __init__(self, gm: fx.GraphModule, example_inputs: list, patches: dict):
        self._gm, self._patches = gm, patches
        floats = [i for i, x in enumerate(example_inputs) if isinstance(x, float)]
        # The use of a float input that kept them constants, for the warning.
        self.refused = tensorify_float_inputs(gm, floats) if floats else None
        self.as_tensors, self.constants = (floats, []) if self.refused is None else ([], floats)
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self._compile(example_inputs)

    def _inputs(self, args: Sequence[Any]) -> list:
        if not self.as_tensors:
            return list(args)
        inputs = list(args)
        for i in self.as_tensors:
            inputs[i] = torch.tensor(inputs[i], dtype=torch.float64)
        return inputs

    def _compile(self, args: Sequence[Any]) -> Callable[..., list]:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # Examples only (Inductor fakifies them). A call's are the DTensors' local tensors, views that
        # the step updated in place, whose autograd metadata the fakification cannot read: detached.
        inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in self._inputs(args)]

        def compiled_and_hazard(patches: dict) -> tuple[Callable[..., list], Optional[CollectiveHazard]]:
            with inductor_config.patch(patches) if patches else contextlib.nullcontext(), _cacheable(inputs), \
                    _without_torch_tensorify(), _generated_wrappers() as sources:
                compiled = compile_fx(copy_graph_module(self._gm), inputs)
            return compiled, next(filter(None, map(collective_hazard, sources)), None)

        compiled, hazard = compiled_and_hazard(self._patches)
        if hazard is not None and hazard.kind == "overwrite":
            # torch 2.13's Inductor frees a collective's input at the call (an `_out` all-gather of a
            # bucket: the next bucket's copy kernel wrote it while gloo still sent it, nondeterministic
            # losses under FSDP). Planned without buffer reuse, every input lives to the end.
            log.info("Inductor's code %s: compiled again without buffer reuse", hazard)
            compiled, hazard = compiled_and_hazard({**self._patches, **_NO_BUFFER_REUSE})
        if hazard is not None:
            warnings.warn(
                f"spmd.compile: Inductor's code for this graph {hazard}, i.e. while the collective still "
                f"uses that memory (an Inductor scheduling error seen on CPU with torch 2.13); the graph runs "
                f"eager instead (slower, the same values as one device). Please report it",
                stacklevel=2,
            )
            compiled = self._gm
        self._compiled[tuple(args[i] for i in self.constants)] = compiled
        while len(self._compiled) > self._KEEP:
            self._compiled.popitem(last=False)
        return compiled

    def __call__(self, *args: Any) -> list:
        key = tuple(args[i] for i in self.constants)
        compiled = self._compiled.get(key)
        if compiled is None:
            warnings.warn(
                f"spmd.compile: the Inductor-compiled step holds float inputs {self.constants} (optimizer "
                f"hyperparameters, float arguments of the step or floats it reads from globals) as constants, "
                f"and they changed to {list(key)}: compiling the step again "
                f"for these values (spmd_expand.tensorify cannot pass them as tensors through "
                f"{self.refused.format_node()[:200]}). lower=\"eager\" takes them as inputs",
                stacklevel=2,
            )
            compiled = self._compile(args)
        else:
            self._compiled.move_to_end(key)
        return compiled(*self._inputs(args))


def _for_inductor(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that Inductor (torch 2.13, CPU) compiles: :func:`_views_as_reshapes`, then
    :func:`_bool_collectives_as_uint8`, :func:`_alpha_as_mul`. ``gm`` itself stays as it is
    (``step.last.local_graph``)."""
    copy = copy_graph_module(gm)
    _views_as_reshapes(copy)
    _bool_collectives_as_uint8(copy)
    _alpha_as_mul(copy)
    copy.recompile()
    return copy


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """Make the ``aten.view`` nodes of ``gm`` ``aten.reshape`` nodes.

    The graph's views were recorded against the strides that ATen's meta functions give. Inductor
    traces the graph again through its own decompositions, and some of them return other (equally
    valid) strides: ``torch._inductor.decomposition.cat`` of one non-empty tensor and legacy empty
    ones returns a ``clone`` that keeps its input's strides where ATen's ``cat`` returns a contiguous
    tensor (HF T5's attention cache: ``cat([tensor([]), key_states], -2)`` of a transposed key), and a
    later ``view`` of it stops the compilation ("Cannot view a tensor with shape ... and strides ...").
    A reshape gives the same values: a view where the strides allow one, a copy where they do not.
    The graph writes only into its inputs (the write-back ``copy_`` of parameters and states); a
    view that some op writes into stays a view.
    """
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        if not any(_writes_into(user, node) for user in node.users):
            node.target = torch.ops.aten.reshape.default


def _bool_collectives_as_uint8(gm: fx.GraphModule) -> None:
    """Run the collectives of ``gm`` that move ``torch.bool`` tensors on ``torch.uint8`` ones.

    Inductor's C++ code generation fails on a bool tensor that a collective wrote, once it is read
    through an index (``CppCSEVariable(... dtype: torch.int64 ...)`` asserting in ``where``): HF
    Llama's padded attention mask, all-gathered under DDP and indexed by position. The collective
    moves the same bytes as uint8: ``x.to(uint8)`` before it, ``.to(bool)`` after its wait.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in COLLECTIVES:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node) or getattr(source.meta.get("val"), "dtype", None) != torch.bool:
            continue
        with graph.inserting_before(node):
            as_uint8 = graph.call_function(torch.ops.aten._to_copy.default, (source,), {"dtype": torch.uint8})
        node.replace_input_with(source, as_uint8)
        for wait in [u for u in node.users if u.target is torch.ops._c10d_functional.wait_tensor.default]:
            with graph.inserting_after(wait):
                as_bool = graph.call_function(torch.ops.aten._to_copy.default, (wait,), {"dtype": torch.bool})
            wait.replace_all_uses_with(as_bool, delete_user_cb=lambda user: user is not as_bool)


def _alpha_as_mul(gm: fx.GraphModule) -> None:
    """Write ``aten.add/sub.Tensor(x, y, alpha=a)`` as ``add/sub(x, mul(y, a))``, what the op computes.

    Inductor's post-grad ``addmm`` pattern (``torch/_inductor/fx_passes/post_grad.py``) turns
    ``add(x, mm(a, b))`` into ``addmm(x, a, b)`` and drops an ``alpha`` it does not match on:
    ``add(x, mm(a, b), alpha=-0.1)`` computes ``x + a @ b``, silently. An optimizer step traced with the
    backward is exactly that: SGD's ``p.add_(grad, alpha=-lr)`` on the gradient of a Linear weight that
    needs no reduction (tensor-parallel shards). With the alpha as a multiplication nothing matches.
    """
    graph = gm.graph
    for target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor):
        for node in list(graph.find_nodes(op="call_function", target=target)):
            alpha = node.kwargs.get("alpha", 1)
            if isinstance(alpha, bool) or (not isinstance(alpha, fx.Node) and alpha == 1):
                continue
            x, y = node.args
            with graph.inserting_before(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (y, alpha))
            node.args, node.kwargs = (x, scaled), {}


def _writes_into(node: fx.Node, operand: fx.Node) -> bool:
    """Whether ``node`` is an ATen op that mutates ``operand`` (an argument its schema marks as written)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    return any(
        arg.alias_info is not None and arg.alias_info.is_write and value is operand
        for arg, value in zip(schema.arguments, node.args)
    )


def _lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], mode: str, ran_passes) -> Callable[..., list]:
    if mode == "eager":
        return gm
    if mode == "inductor":
        from torch._inductor import config as inductor_config

        patches: dict = {}
        if any(draws_random(n) for n in gm.graph.nodes):
            patches["fallback_random"] = True
        on_accelerator = any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in example_inputs)
        if "overlap" in ran_passes and on_accelerator:
            patches["post_grad_custom_post_pass"] = _keep_issue_order_pass(inductor_config.post_grad_custom_post_pass)
        if _OUR_COMM_PASSES & set(ran_passes):
            patches.update(
                {
                    "reorder_for_compute_comm_overlap": False,
                    "reorder_for_peak_memory": False,
                    "bucket_all_gathers_fx": "none",
                    "bucket_reduce_scatters_fx": "none",
                    "bucket_all_reduces_fx": "none",
                    "aten_distributed_optimizations.enable_overlap_scheduling": False,
                }
            )
        return InductorStep(_for_inductor(gm), list(example_inputs), patches)
    raise SpmdError(f"lower={mode!r} is not one of {LOWERINGS}")
