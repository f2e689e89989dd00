"""The pass interface and the manager that runs passes, on torch.fx's pass infrastructure.

A pass is a :class:`SpmdPass` (torch's ``PassBase``: ``requires`` -> ``call`` -> ``ensures``) with a
``name``, a ``stage`` and ordering constraints:

* ``stage = "global"``: runs on the traced global graph before propagation (e.g. re-gathering
  parameters for backward: it adds ``unshard`` markers that propagation then places);
* ``stage = "local"``: runs on this rank's expanded graph (collectives spliced in, every node with a
  ``meta["val"]`` fake tensor of its local shape) before lowering.

:func:`run_passes` hands the passes of one stage to ``torch.fx.passes.infra.pass_manager.PassManager``
(ordering from each pass's ``run_after``, ``graph.lint()`` after every pass), times each pass and
keeps a snapshot of the graph after it. Whatever goes wrong inside a pass is re-raised as a
:class:`~spmd_expand.errors.PassError` that names the pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager, this_before_that_pass_constraint

from ..errors import PassError, SpmdError

__all__ = ["PassContext", "PassRecord", "SpmdPass", "FunctionPass", "run_passes", "copy_graph_module"]


@dataclass
class PassContext:
    """What a pass may read besides the graph: the mesh, the resolved plan, the traced step.

    Set by the pipeline as ``gm.meta["spmd_pass_context"]`` before a stage's passes run.
    ``split_graph`` is True for the forward and backward graphs split from a joint graph
    (``torch.compile(backend="spmd")``) and False for a whole step (``spmd.compile``).
    """

    mesh: Any
    plan: Any
    traced: Any = None
    split_graph: bool = False


class SpmdPass(PassBase):
    """A graph pass of the pipeline.

    Subclasses set ``name`` (what ``spmd.compile(passes=[...])`` and ``spmd-expand dump`` call it),
    ``stage`` (``"global"`` or ``"local"``) and ``run_after`` (names of passes that must run first when
    both are in the pipeline), and implement ``call(gm) -> PassResult``. ``requires`` / ``ensures``
    raise :class:`PassError` when the graph is not what the pass needs / what it promised.
    """

    name: str = ""
    stage: str = "local"
    run_after: tuple[str, ...] = ()

    def context(self, gm: fx.GraphModule) -> PassContext:
        ctx = gm.meta.get("spmd_pass_context")
        if ctx is None:
            raise PassError(f"pass {self.name!r} needs the pipeline's PassContext in gm.meta['spmd_pass_context']")
        return ctx

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionPass(SpmdPass):
    """A plain callable ``fn(gm)`` on the local graph as a pass (it may return a ``PassResult``, a
    graph module, or nothing: then the graph counts as modified)."""

    def __init__(self, fn: Callable[[fx.GraphModule], Any]):
        super().__init__()
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)

    def call(self, gm: fx.GraphModule) -> PassResult:
        result = self.fn(gm)
        if isinstance(result, PassResult):
            return result
        return PassResult(result if isinstance(result, fx.GraphModule) else gm, True)


@dataclass
class PassRecord:
    """One pass as it ran: its name, wall seconds, whether it changed the graph, and (when kept) a
    snapshot of the graph after it."""

    name: str
    seconds: float
    modified: bool
    graph: Optional[fx.GraphModule] = field(default=None, repr=False)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph later passes can rewrite without touching this one.

    Node metas are copied shallowly (fake tensors and shardings are shared, not duplicated)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    # graph_copy drops the output node's meta; nothing reads it.
    copy = _make_graph_module(gm, graph)  # lazy (no Python code generated) under _use_lazy_graph_module
    copy.meta.update(gm.meta)
    return copy


def _timed(p: SpmdPass, records: list[PassRecord], keep_graphs: bool) -> Callable[[fx.GraphModule], PassResult]:
    def run(gm: fx.GraphModule) -> PassResult:
        start = time.perf_counter()
        try:
            result = p(gm)
        except SpmdError as e:
            if isinstance(e, PassError) and p.name in str(e):
                raise
            raise PassError(f"pass {p.name!r} failed: {e}") from e
        except Exception as e:
            raise PassError(f"pass {p.name!r} failed: {type(e).__name__}: {e}") from e
        if result is None:  # PassBase.__call__ returns call()'s result; tolerate passes returning None
            result = PassResult(gm, True)
        seconds = time.perf_counter() - start
        records.append(
            PassRecord(p.name, seconds, bool(result.modified), copy_graph_module(result.graph_module) if keep_graphs else None)
        )
        return result

    run.__name__ = p.name
    return run


def run_passes(
    gm: fx.GraphModule, passes: Sequence[SpmdPass], context: PassContext, keep_graphs: bool = False
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run ``passes`` (one stage's) on ``gm`` in an order that honours every ``run_after``.

    Returns the resulting graph module and one :class:`PassRecord` per pass, in the order they ran;
    with ``keep_graphs`` each record holds a copy of the graph after its pass.

    Raises:
        PassError: a pass's ``requires``/``call``/``ensures`` failed, the graph after a pass does not
            lint, or the ``run_after`` constraints form a cycle. The message names the pass.
    """
    records: list[PassRecord] = []
    if not passes:
        return gm, records
    gm.meta["spmd_pass_context"] = context
    wrapped = {p.name: _timed(p, records, keep_graphs) for p in passes}
    constraints = [
        this_before_that_pass_constraint(wrapped[before], wrapped[p.name])
        for p in passes
        for before in p.run_after
        if before in wrapped
    ]
    manager = PassManager(list(wrapped.values()), constraints, run_checks_after_each_pass=True)

    def lint(module: fx.GraphModule) -> None:
        module.graph.lint()

    manager.add_checks(lint)
    try:
        result = manager(gm)
    except PassError:
        raise
    except Exception as e:  # PassManager wraps a pass's exception in a plain Exception
        cause = e.__cause__
        if isinstance(cause, SpmdError):
            raise cause from cause.__cause__
        failed = records[-1].name if records else "(before the first pass)"
        raise PassError(f"the graph after pass {failed!r} is not valid: {cause or e}") from e
    finally:
        gm.meta.pop("spmd_pass_context", None)
    result.graph_module.meta.pop("spmd_pass_context", None)
    return result.graph_module, records
