"""``spmd-expand dump``: expand a train step without real ranks and write every stage's graph.

The step runs on torch's fake process group (any world size: collectives are no-ops, only graphs are
kept), twice, so the graph written is the steady-state one (the first call creates the optimizer's
states). For each stage of the pipeline the dump folder gets one text file (format in
:mod:`spmd_expand.tools.graph_text`):

====================  ==============================================================================
``1-traced.txt``      the global graph of the whole step (forward, backward, optimizer) as propagation
                      receives it (with the plan's markers, e.g. FSDP's re-gathers); global shapes
``2-annotated.txt``   the same graph with each node's output placements and the redistributions
                      its inputs need (``%x{P(sum)->R}``); global shapes
``3-expanded.txt``    the per-rank graph: collectives spliced in, sizes local; rank 0's local shapes
``4-<pass>.txt``      the per-rank graph after each local pass of the pipeline (``4-bucketing.txt``,
                      ``4-overlap.txt``; order in ``summary.json``'s ``passes``)
``4-passes.txt``      the per-rank graph after all graph passes: what is lowered and runs
``summary.json``      collectives per step (count and bytes by kind), nodes per stage, bytes per rank
``graph.html``        a picture of the graph after passes: collectives highlighted, placements on edges
====================  ==============================================================================

The job is a built-in model (``--model mlp|gpt``) or ``--job module:function``; the function takes no
arguments and returns a :class:`Job` (or the tuple ``(model, optimizer, batch, step)``) where ``batch``
is one rank's local batch and the step is called as ``step(model, optimizer, *batch)``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import operator
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.fx.graph import dtype_abbrs

import spmd_expand as spmd

from ..dsymint import DSymInt, local_strides
from ..graph_stats import annotate_local_values, collective_stats, peak_live_bytes
from ..app.models import MLP, GPTConfig, build_gpt, classification_step, language_model_step
from ..errors import PlanError
from ..app.presets import PRESETS, Preset, mesh_shape, positive_int, preset
from ..spec import concrete, local_shape
from ..trace import InputRole
from .graph_text import (
    NAME_CHARS,
    SUMMARY_FORMAT,
    DumpNode,
    format_graph_text,
    parse_graph_text,
)
from .picture import render_html

__all__ = [
    "Job",
    "BUILTIN_JOBS",
    "builtin_job",
    "STAGES",
    "Stage",
    "Dump",
    "DumpError",
    "load_job",
    "mesh_shape",
    "fake_process_group",
    "node_names",
    "graph_dump_nodes",
    "dump_step",
    "run_dump",
    "write_dump",
    "write_text_atomic",
    "add_arguments",
    "run",
]

# The step is called this many times; the last call's graph is dumped (steady state: optimizer
# states created by the first call exist).
STEP_CALLS = 2


class DumpError(spmd.SpmdError):
    """The dump cannot start: a bad job, a plan that does not fit the mesh, a process group in the way."""


# ---------------------------------------------------------------------------------------- jobs
@dataclass
class Job:
    """What to dump: ``step(model, optimizer, *batch)`` with ``batch`` one rank's local batch."""

    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    batch: tuple
    step: Callable[..., Any]


def mlp_job() -> Job:
    """:class:`~spmd_expand.app.models.MLP` (16 -> 32 -> 4) with AdamW; local batch of 2 rows."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    batch = (torch.randn(2, 16, generator=generator), torch.randint(0, 4, (2,), generator=generator))
    return Job(model, optimizer, batch, classification_step)


def gpt_job(layers: int = 1) -> Job:
    """A small GPT (vocab 32, 8 positions, width 16, 2 heads, ``layers`` blocks) with SGD and
    momentum; local batch of 2 sequences. Small so its graphs stay reviewable (golden files)."""
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=layers, n_head=2, n_embd=16)
    model = build_gpt(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size), generator=generator)
    return Job(model, optimizer, (idx, torch.roll(idx, -1, dims=1)), language_model_step)


BUILTIN_JOBS: dict[str, Callable[..., Job]] = {"mlp": mlp_job, "gpt": gpt_job}


def builtin_job(model: str, layers: Optional[int] = None) -> tuple[Job, str]:
    """The built-in job ``model`` (``--model``) and the source its dump header names (``model=gpt``).

    Raises:
        DumpError: unknown model, or ``layers`` for a model without layers.
    """
    if model not in BUILTIN_JOBS:
        raise DumpError(f"unknown model {model!r}; one of {', '.join(BUILTIN_JOBS)}")
    if layers is None:
        return BUILTIN_JOBS[model](), f"model={model}"
    if model != "gpt":
        raise DumpError("--layers applies to --model gpt only")
    return gpt_job(layers), f"model=gpt layers={layers}"


def _as_job(result: Any, where: str) -> Job:
    if isinstance(result, tuple) and len(result) == 4:
        result = Job(*result)
    if not isinstance(result, Job):
        raise DumpError(f"{where} returned a {type(result).__name__}; return a Job or (model, optimizer, batch, step)")
    if not isinstance(result.model, nn.Module):
        raise DumpError(f"{where}: the model is a {type(result.model).__name__}, not an nn.Module")
    if result.optimizer is not None and not isinstance(result.optimizer, torch.optim.Optimizer):
        raise DumpError(f"{where}: the optimizer is a {type(result.optimizer).__name__}, not a torch.optim.Optimizer")
    if not callable(result.step):
        raise DumpError(f"{where}: the step is a {type(result.step).__name__}, not a function")
    result.batch = tuple(result.batch) if isinstance(result.batch, (list, tuple)) else (result.batch,)
    return result


def load_job(spec: str) -> Job:
    """Import ``module:function`` (or ``path/to/file.py:function``) and call the function.

    The current directory is importable, as for ``python -m``.

    Raises:
        DumpError: ``spec`` is malformed, the module or function cannot be found, or the function
            returns something other than a :class:`Job` / ``(model, optimizer, batch, step)``.
    """
    module_name, sep, function_name = spec.rpartition(":")
    if not sep or not module_name or not function_name:
        raise DumpError(f"--job {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise DumpError(f"--job {spec!r}: no file {module_name}")
        # A name of its own, so the file does not shadow an imported module of the same stem.
        name = f"spmd_expand_job_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
        import_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(import_spec)
        sys.modules[name] = module
        try:
            import_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: any error is bad input
            raise DumpError(f"--job {spec!r}: loading {module_name} failed: {type(e).__name__}: {e}") from e
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - ImportError, or the module's own error while importing
            raise DumpError(f"--job {spec!r}: cannot import {module_name}: {type(e).__name__}: {e}") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise DumpError(f"--job {spec!r}: {module_name} has no function {function_name}")
    try:
        made = function()
    except Exception as e:  # noqa: BLE001 - the user's job: any error is bad input
        raise DumpError(f"--job {spec!r}: {function_name}() raised {type(e).__name__}: {e}") from e
    return _as_job(made, f"--job {spec}")


# ---------------------------------------------------------------------------------------- plans and mesh
def _plan_choice(plan_name: str, shape: tuple[int, ...]) -> Preset:
    try:
        choice = preset(plan_name)
    except PlanError as e:
        raise DumpError(str(e)) from None
    if len(shape) != len(choice.mesh_dim_names):
        raise DumpError(
            f"plan {plan_name} needs a {len(choice.mesh_dim_names)}-D mesh ({', '.join(choice.mesh_dim_names)}); "
            f"got mesh shape {'x'.join(map(str, shape))}"
        )
    return choice


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks (this process is rank 0), removed on exit.

    Raises:
        DumpError: this process already has a default process group.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise DumpError(
            "this process already has a default process group; dump in a fresh process "
            "(spmd-expand dump) or pass the mesh of that group to dump_step"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- fx -> text
@dataclass(frozen=True)
class Stage:
    """A stage of the pipeline as dumped: its name, its file in the dump folder, and what it shows."""

    name: str
    file: str
    description: str


STAGES = (
    Stage(
        "traced",
        "1-traced.txt",
        "global graph of the whole step (forward, backward, optimizer) as propagation receives it; global shapes",
    ),
    Stage(
        "annotated",
        "2-annotated.txt",
        "global graph with each node's output placements; %x{SRC->DST}: input x is redistributed on that edge; global shapes",
    ),
    Stage("expanded", "3-expanded.txt", "per-rank graph: collectives spliced in, sizes local; local shapes of rank 0"),
    Stage("passes", "4-passes.txt", "per-rank graph after the graph passes (what is lowered and runs); local shapes of rank 0"),
)


class _Text:
    """An argument already rendered (a node reference, a process group)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NOT_NAME = re.compile(rf"[^{NAME_CHARS}]")
_NOT_OP = re.compile(r"[^A-Za-z0-9_.]")


def _render(x: Any) -> str:
    """A literal argument as deterministic Python-like text (no memory addresses)."""
    if isinstance(x, _Text):
        return x.text
    if isinstance(x, list):
        return "[" + ", ".join(_render(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(_render(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return repr(concrete(x))
    return _ADDRESS.sub("", repr(x))


def _op(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op if node.op in ("placeholder", "get_attr", "output") else f"{node.op}.{_NOT_OP.sub('_', str(node.target))}"
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    name = getattr(target, "__name__", type(target).__name__)
    if getattr(operator, name, None) is target:
        return f"operator.{name}"
    return _NOT_OP.sub("_", f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', name)}").strip(".")


def _short_name(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"attr:{node.target}"
    if node.op != "call_function":
        return node.op
    target = node.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", None) or "call"


def _role_name(role: InputRole) -> str:
    if role.kind == "state":
        return f"state:{role.fqn}:{role.key}"
    if role.kind == "batch":
        return f"batch:{role.key}"
    return ":".join(p for p in (role.kind, role.fqn, role.key) if p)


def node_names(graph: fx.Graph, roles: Sequence[InputRole]) -> dict[fx.Node, str]:
    """Normalized names: placeholders by role (``param:fc1.weight``), others by op in graph order
    (``addmm``, ``addmm_1``, ...), so they do not depend on tracing history."""
    names: dict[fx.Node, str] = {}
    taken: set[str] = set()
    placeholder_index = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            base = _role_name(roles[placeholder_index]) if placeholder_index < len(roles) else f"input:{placeholder_index}"
            placeholder_index += 1
        else:
            base = _short_name(node)
        base = _NOT_NAME.sub("_", base)
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        names[node] = name
    return names


def _placements(placements: Sequence[Any]) -> str:
    return ",".join(str(p).replace(" ", "") for p in placements)


def _sharding_text(out: Any) -> str:
    """``NodeSharding.output`` as PLACEMENTS text."""
    if isinstance(out, DTensorSpec):
        return _placements(out.placements)
    if isinstance(out, (list, tuple)):
        return "(" + ",".join(_sharding_text(o) for o in out) + ")"
    if isinstance(out, DSymInt):
        return f"DSymInt(global={out.global_value},local={out.local_value})"
    return "-" if out is None else type(out).__name__


def _value_text(val: Any) -> str:
    """``node.meta["val"]`` as VALUE text: ``f32[2,16]``, ``int(4)``, ``(f32[],f32[])``."""
    if val is None:
        return "-"
    if isinstance(val, torch.Tensor):
        dtype = dtype_abbrs.get(val.dtype, str(val.dtype).replace("torch.", ""))
        return f"{dtype}[{','.join(str(concrete(s)) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        inner = ",".join(_value_text(v) for v in val)
        return f"[{inner}]" if isinstance(val, list) else f"({inner})"
    if isinstance(val, (bool, torch.SymBool)):
        return f"bool({concrete(val)})"
    if isinstance(val, (int, torch.SymInt)):
        return f"int({concrete(val)})"
    if isinstance(val, (float, torch.SymFloat)):
        return f"float({concrete(val)!r})"
    return type(val).__name__


def _args_text(node: fx.Node, names: dict[fx.Node, str], groups: dict[str, str], with_edges: bool) -> str:
    """ARGS of ``node``: references as ``%name`` (with ``{SRC->DST}`` where ``with_edges`` and the
    input is redistributed), process group names as ``group(<mesh dim>)``."""
    if node.op in ("placeholder", "get_attr"):
        return ""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if isinstance(node.target, torch._ops.OpOverload):
        schema = [a.name for a in node.target._schema.arguments]
        args = tuple(
            _Text(f"group({groups[a]})") if i < len(schema) and schema[i] == "group_name" and a in groups else a
            for i, a in enumerate(args)
        )
        if kwargs.get("group_name") in groups:
            kwargs["group_name"] = _Text(f"group({groups[kwargs['group_name']]})")
    leaves, tree = pytree.tree_flatten((args, kwargs))
    sharding = node.meta.get("spmd") if with_edges else None
    # Mirrors expand: NodeSharding.inputs lines up with the flattened (args, kwargs) leaves.
    wanted = list(sharding.inputs) if sharding is not None and not sharding.rank_local else []
    wanted += [None] * (len(leaves) - len(wanted))
    rendered = []
    for leaf, dst in zip(leaves, wanted):
        if isinstance(leaf, fx.Node):
            text = f"%{names[leaf]}"
            src = getattr(leaf.meta.get("spmd"), "output", None)
            if isinstance(src, DTensorSpec) and isinstance(dst, DTensorSpec) and src.placements != dst.placements:
                text += f"{{{_placements(src.placements)}->{_placements(dst.placements)}}}"
            leaf = _Text(text)
        rendered.append(leaf)
    args, kwargs = pytree.tree_unflatten(rendered, tree)
    return ", ".join([_render(a) for a in args] + [f"{k}={_render(v)}" for k, v in kwargs.items()])


def _local_placements(node: fx.Node) -> str:
    redistribution = node.meta.get("spmd_redistribute")
    if redistribution is not None:
        src, dst = redistribution
        return f"{_placements(src)}->{_placements(dst)}"
    sharding = node.meta.get("spmd")
    return _sharding_text(sharding.output) if sharding is not None else "-"


def graph_dump_nodes(
    gm: fx.GraphModule,
    roles: Sequence[InputRole],
    groups: dict[str, str],
    placements: Callable[[fx.Node], str],
    with_edges: bool = False,
) -> list[DumpNode]:
    """The node lines of ``gm``: normalized names, op, args, ``placements(node)``, ``meta["val"]``."""
    names = node_names(gm.graph, roles)
    return [
        DumpNode.make(names[n], _op(n), _args_text(n, names, groups, with_edges), placements(n), _value_text(n.meta.get("val")))
        for n in gm.graph.nodes
    ]


# ---------------------------------------------------------------------------------------- the dump
@dataclass
class Dump:
    """Everything a dump writes except the picture: text form per stage name, and the JSON summary.

    ``stages`` lists the stages written, in pipeline order: :data:`STAGES` with one stage per local
    pass inserted before the last (``pass:<name>``, file ``4-<name>.txt``)."""

    texts: dict[str, str]
    summary: dict[str, Any]
    stages: tuple[Stage, ...] = STAGES


def _local_examples(traced_gm: fx.GraphModule) -> list[torch.Tensor]:
    """Rank 0's local inputs: tensors (uninitialized) from each placeholder's global spec and placements,
    and the example value of each hyperparameter."""
    examples = []
    for node in traced_gm.graph.find_nodes(op="placeholder"):
        spec: DTensorSpec = node.meta["spmd"].output
        if not isinstance(spec, DTensorSpec):
            examples.append(spec)
            continue
        meta = spec.tensor_meta
        shape = local_shape(spec)
        examples.append(torch.empty_strided(shape, local_strides(meta.shape, meta.stride, shape), dtype=meta.dtype))
    return examples


def _persistent_bytes(gm: fx.GraphModule, roles: Sequence[InputRole]) -> dict[str, int]:
    """Bytes per rank of the step's inputs that live across steps (all but the batch), by role."""
    keys = {"param": "params", "buffer": "buffers", "grad": "grads", "state": "optimizer_states"}
    result = dict.fromkeys(keys.values(), 0)
    for node, role in zip(gm.graph.find_nodes(op="placeholder"), roles):
        val = node.meta.get("val")
        if role.kind in keys and isinstance(val, torch.Tensor):
            result[keys[role.kind]] += val.numel() * val.element_size()
    result["total"] = sum(result.values())
    return result


def _mesh_label(mesh: DeviceMesh, dim_names: Sequence[str]) -> str:
    return "x".join(str(s) for s in mesh.shape) + f"({','.join(dim_names)})"


def dump_step(job: Job, plan_name: str, mesh: DeviceMesh, source: str) -> Dump:
    """Compile ``job`` under the preset ``plan_name`` on ``mesh``, run it :data:`STEP_CALLS` times, and
    render every stage of the last call's compilation.

    ``mesh`` may be over a fake process group (collectives are no-ops; only graphs are read).
    ``source`` describes the job in the dump's header (e.g. ``"model=mlp"``); keep it free of
    absolute paths so dumps compare across machines.

    Raises:
        DumpError: the plan is unknown or needs another number of mesh dims than ``mesh`` has.
        SpmdError: compiling the step failed (the pipeline's own errors).
    """
    choice = _plan_choice(plan_name, tuple(mesh.shape))
    dim_names = tuple(mesh.mesh_dim_names or choice.mesh_dim_names)
    compiled = spmd.compile(mesh=mesh, plan=choice.build(job.model), lower="eager", keep_graphs=True)(job.step)
    for _ in range(STEP_CALLS):
        compiled(job.model, job.optimizer, *job.batch)
    artifacts = compiled.last
    traced = artifacts.traced
    # Hyperparameters follow the tensor inputs: %hyperparameter:0.lr = placeholder().
    roles = list(traced.inputs) + [InputRole("hyperparameter", key=hp.name) for hp in traced.hyperparameters]
    groups = {mesh.get_group(d).group_name: name for d, name in enumerate(dim_names)}

    # The pipeline kept every stage: the expanded graph and the graph after each local pass.
    expanded = artifacts.expanded
    after_passes = artifacts.local_graph
    local_passes = [r for r in artifacts.passes if r.graph is not None and r.name in {p.name for p in compiled.local_passes}]
    examples = _local_examples(traced.graph_module)
    for gm in (expanded, after_passes, *(r.graph for r in local_passes)):
        annotate_local_values(gm, examples)
    pass_stages = tuple(
        Stage(f"pass:{r.name}", f"4-{r.name}.txt", f"per-rank graph after the {r.name!r} pass; local shapes of rank 0")
        for r in local_passes
    )
    stage_list = (*STAGES[:-1], *pass_stages, STAGES[-1])

    header = {
        "job": f"{source} plan={plan_name} mesh={_mesh_label(mesh, dim_names)} world_size={mesh.size()} rank=0",
        "step": f"call {STEP_CALLS} (steady state: optimizer states exist)",
    }
    no_edges: Callable[[fx.Node], str] = lambda n: "-"  # noqa: E731
    annotated: Callable[[fx.Node], str] = lambda n: _sharding_text(getattr(n.meta.get("spmd"), "output", None))  # noqa: E731
    graphs = {
        "traced": (traced.graph_module, no_edges, False, False),
        "annotated": (traced.graph_module, annotated, True, False),
        "expanded": (expanded, _local_placements, False, True),
        "passes": (after_passes, _local_placements, False, True),
        **{stage.name: (r.graph, _local_placements, False, True) for stage, r in zip(pass_stages, local_passes)},
    }
    texts: dict[str, str] = {}
    stages: dict[str, Any] = {}
    for stage in stage_list:
        gm, placements, with_edges, is_local = graphs[stage.name]
        nodes = graph_dump_nodes(gm, roles, groups, placements, with_edges)
        stats = collective_stats(gm) if is_local else None
        collectives = {k: (v["count"], v["bytes"]) for k, v in stats.as_dict().items()} if stats else {}
        texts[stage.name] = format_graph_text(
            {"stage": stage.name, "description": stage.description, **header}, collectives, nodes
        )
        stages[stage.name] = {"file": stage.file, "nodes": len(nodes)}
        if stats is not None:
            stages[stage.name]["collectives"] = stats.as_dict()

    summary = {
        "format": SUMMARY_FORMAT,
        "job": {
            "source": source,
            "plan": plan_name,
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(dim_names),
            "world_size": mesh.size(),
            "rank": 0,
            "step_call": STEP_CALLS,
        },
        "stages": stages,
        "passes": [{"name": r.name, "modified": r.modified} for r in artifacts.passes],
        "collectives_per_step": stages["passes"]["collectives"],
        "persistent_bytes_per_rank": _persistent_bytes(after_passes, roles),
        "peak_live_bytes_per_rank": peak_live_bytes(after_passes)["peak"],
    }
    return Dump(texts, summary, stage_list)


def run_dump(job: Job, plan_name: str, shape: Sequence[int], source: str) -> Dump:
    """:func:`dump_step` on a fresh fake process group and mesh of ``shape`` (dims named by the plan).

    Raises:
        DumpError: unknown plan, mesh rank that does not fit the plan, or a process group in the way.
    """
    dim_names = _plan_choice(plan_name, tuple(shape)).mesh_dim_names
    with fake_process_group(math.prod(shape)):
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=dim_names)
        return dump_step(job, plan_name, mesh, source)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: readers see the old
    file or the new one, never half of one (e.g. on Ctrl-C)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_dump(dump: Dump, out: Path, picture: bool = True) -> list[Path]:
    """Write the stage texts, ``summary.json`` and (with ``picture``) ``graph.html`` under ``out``.

    Returns the paths written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stage in dump.stages:
        write_text_atomic(out / stage.file, dump.texts[stage.name])
        written.append(out / stage.file)
    write_text_atomic(out / "summary.json", json.dumps(dump.summary, indent=2) + "\n")
    written.append(out / "summary.json")
    if picture:
        final = parse_graph_text(dump.texts["passes"], STAGES[-1].file)
        write_text_atomic(out / "graph.html", render_html(final, dump.summary))
        written.append(out / "graph.html")
    return written


# ---------------------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``spmd-expand dump``."""
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", choices=sorted(BUILTIN_JOBS), help="a built-in job: the MLP or a small GPT")
    what.add_argument(
        "--job",
        metavar="MODULE:FUNCTION",
        help="a function (no arguments) returning (model, optimizer, local batch tuple, step fn); "
        "MODULE may also be a path to a .py file",
    )
    p.add_argument(
        "--plan",
        choices=list(PRESETS),
        default="ddp",
        help="; ".join(f"{name}: {c.help}" for name, c in PRESETS.items()),
    )
    p.add_argument("--mesh", type=mesh_shape, metavar="SHAPE", help="mesh shape, e.g. 8 or 2x4 (default: --world-size)")
    p.add_argument("--world-size", type=positive_int, metavar="W", help="number of (fake) ranks; default 2, or the mesh's size")
    p.add_argument("--layers", type=positive_int, metavar="N", help="transformer layers of --model gpt (default 1)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write the dump to")
    p.add_argument("--no-picture", dest="picture", action="store_false", help="skip graph.html")


def _usage_error(message: str) -> int:
    print(f"spmd-expand dump: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run ``spmd-expand dump``; returns the exit status (2 for bad input, printed to stderr)."""
    shape = args.mesh or (args.world_size or 2,)
    size = math.prod(shape)
    if args.world_size is not None and args.world_size != size:
        return _usage_error(f"--world-size {args.world_size} does not match --mesh {'x'.join(map(str, shape))} ({size} ranks)")
    if args.job and args.layers is not None:
        return _usage_error("--layers applies to --model gpt only")
    if args.out.exists() and not args.out.is_dir():
        return _usage_error(f"--out {args.out} is a file; give a folder (created if missing)")
    try:
        if args.model:
            job, source = builtin_job(args.model, args.layers)
        else:
            job, source = load_job(args.job), f"job={args.job}"
        dump = run_dump(job, args.plan, shape, source)
    except DumpError as e:
        return _usage_error(str(e))
    except spmd.SpmdError as e:  # the step cannot be compiled for this plan: the message says why
        return _usage_error(f"compiling the step failed: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - the user's step raised while tracing
        return _usage_error(f"the step raised {type(e).__name__}: {e}")
    written = write_dump(dump, args.out, picture=args.picture)
    summary = dump.summary
    nodes = ", ".join(f"{name} {s['nodes']}" for name, s in summary["stages"].items())
    comms = ", ".join(f"{v['count']} {k} ({v['bytes']:,} B)" for k, v in summary["collectives_per_step"].items())
    print(f"wrote {len(written)} files to {args.out}")
    print(f"nodes per stage: {nodes}")
    print(f"collectives per step (rank 0): {comms or 'none'}")
    print(f"persistent bytes per rank: {summary['persistent_bytes_per_rank']['total']:,}")
    return 0
