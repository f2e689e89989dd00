"""Choosing among DTensor's strategies for an op by communication *and* compute per rank.

DTensor's sharding propagator (``propagate_op_sharding_non_cached`` in
``torch/distributed/tensor/_sharding_prop.py``) expands an op's strategies into an ``OpStrategy``: one
``OpSpec`` per candidate (input specs, output specs, and ``redistribute_cost`` (``_op_schema.py``), the cost of moving each
current input to the candidate's input spec, from ``generate_redistribute_costs`` in
``torch/distributed/tensor/_ops/utils.py`` / ``redistribute_cost`` in ``_collective_utils.py``: an
alpha-beta model of ring collectives in microseconds, with NVLink-class bandwidth). It then keeps the
candidate with the cheapest redistribution (``_select_min_cost_strategy``): a candidate that needs no
redistribution wins outright, whatever it computes. Under a data-parallel plan this can be costly: a
BatchNorm has no batch-sharded strategy, DTensor may all-gather its input to ``Replicate``, and every op
after it then takes its replicated input as is (no redistribution is cheapest), so convolutions run on
the *global* batch on every rank.

:mod:`spmd_expand.propagate` keeps DTensor doing the propagation and changes only which of its answers
is taken, with this cost model (per op, in microseconds)::

    cost = sum of redistribute_cost(current input spec, wanted input spec)   # DTensor's own estimate
         + compute_us(op) / (ranks that split the op's main output)
    compute_us(op) = FLOPs(op) / PEAK_FLOPS_PER_US + bytes(op's global inputs and outputs) / MEMORY_BYTES_PER_US

FLOPs come from torch's flop registry (``torch.utils.flop_counter.flop_registry``: matmuls,
convolutions, attention); every op also pays for the bytes it reads and writes, so pointwise and
normalization ops have a cost too. A mesh dim splits the work when the main output (the largest one)
is not ``Replicate`` on it (``Shard``: each rank computes its rows; ``Partial``: each rank reduces its
part of the contraction). The constants are one accelerator of the class DTensor's communication
model assumes.

It applies only where DTensor's choice leaves the *data-parallel layout*: the main output is not
sharded on a batch dim on every mesh dim the plan shards the batch over. A batch dim is a dim whose
(symbolic) global size derives from a size of a graph input the plan shards on that mesh dim (the
global graph is traced with symbolic batch sizes; :class:`BatchSymbols`). There, two things are tried,
each kept only if it restores the batch layout at a lower cost:

1. **DTensor's strategies, chosen by cost.** :func:`choosing_by_cost` swaps DTensor's
   ``_select_min_cost_strategy`` for one call of ``propagate_op_sharding_non_cached``: DTensor still
   builds the ``OpStrategy``, costs each candidate's redistribution (``OpSpec.redistribute_cost``) and
   writes the suggested input specs; among its own choice and the candidates that keep the batch
   layout, the cheapest by the model above is taken.
2. **The replicated inputs split on the batch.** DTensor's pointwise and follow-the-input strategies
   (and rules such as ``convolution``'s) only offer the placements of the inputs they get: a
   replicated activation stays replicated, and every op after it computes the global batch on every
   rank. Splitting a replicated input on its batch dim is a local chunk (``Replicate -> Shard``, no
   communication), so propagation asks DTensor again with those inputs ``Shard(batch dim)`` and
   takes that answer if it keeps the batch layout and costs less (it always computes less).

Everything else keeps DTensor's choice: an op with no batch dim, one whose DTensor choice already
keeps the batch layout, every op of a plan that does not shard the batch (tensor parallel). Limiting
the alternatives to the batch layout matters: a free split on another dim is cheap for the op but
costs a collective later (e.g. before a tensor-parallel linear), which a node-by-node choice cannot
see; the batch layout is the one the plan's inputs and gradient reductions are built for. Ties keep
DTensor's choice.

Example: BatchNorm has no batch-sharded strategy in DTensor (``batch_norm_strategy`` in
``_ops/_math_ops.py``: replicated or channel-sharded). On small activations DTensor all-gathers its
input to ``Replicate`` (cheaper than the all-to-all to channels by its model); the ``relu`` after it
is then split back onto the batch by (2), and the convolutions after it run on the local batch.
"""

from __future__ import annotations

import contextlib
import math
from itertools import chain
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

from .graph_stats import node_flops
from .spec import concrete

__all__ = ["PEAK_FLOPS_PER_US", "MEMORY_BYTES_PER_US", "BatchSymbols", "NodeCost", "choosing_by_cost", "compute_us"]

# One accelerator of the class DTensor's communication model assumes (Ampere/Hopper with NVLink):
# dense half-precision matmul throughput and HBM bandwidth, per microsecond.
PEAK_FLOPS_PER_US = 100e12 / 1e6
MEMORY_BYTES_PER_US = 2e12 / 1e6


class BatchSymbols:
    """Which symbolic sizes of the global graph the plan shards, and on which mesh dims.

    Filled from the graph inputs: a dim of an input that is ``Shard(d)`` on mesh dim ``m`` and whose
    global size is symbolic makes every symbol of that size a batch symbol on ``m``.
    """

    def __init__(self) -> None:
        self.mesh_dims: dict[Any, set[int]] = {}

    def add_input(self, val: Any, placements) -> None:
        if not isinstance(val, torch.Tensor):
            return
        for m, p in enumerate(placements):
            if isinstance(p, Shard) and val.dim():
                size = val.shape[p.dim % val.dim()]
                for sym in _symbols(size):
                    self.mesh_dims.setdefault(sym, set()).add(m)

    def of_size(self, size: Any) -> set[int]:
        """Mesh dims the plan shards a dim of this global size over (empty: not a batch dim)."""
        out: set[int] = set()
        for sym in _symbols(size):
            out |= self.mesh_dims.get(sym, set())
        return out

    def dims_of(self, val: Any) -> dict[int, set[int]]:
        """Mesh dim -> the dims of tensor ``val`` (global, symbolic sizes) that are batch dims on it."""
        dims: dict[int, set[int]] = {}
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                for m in self.of_size(size):
                    dims.setdefault(m, set()).add(d)
        return dims

    def __bool__(self) -> bool:
        return bool(self.mesh_dims)


def _symbols(size: Any) -> set:
    if isinstance(size, torch.SymInt):
        return set(size.node.expr.free_symbols)
    return set()


def _tensor_leaves(x: Any) -> list:
    return [v if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(x)] if isinstance(x, (tuple, list)) else [x]


def _numel(val: torch.Tensor) -> int:
    return math.prod(int(concrete(s)) for s in val.shape)


def compute_us(node: fx.Node) -> float:
    """Estimated time of ``node`` on one device over its global tensors (see the module docstring)."""
    vals = [v for v in pytree.tree_leaves((node.args, node.kwargs, node.meta.get("val")), is_leaf=lambda a: isinstance(a, fx.Node))]
    vals = [v.meta.get("val") if isinstance(v, fx.Node) else v for v in vals]
    moved = sum(_numel(v) * v.element_size() for v in vals if isinstance(v, torch.Tensor))
    try:
        flops = node_flops(node)
    except Exception:  # noqa: BLE001 - an estimate; a formula that cannot read these args counts 0
        flops = 0
    return flops / PEAK_FLOPS_PER_US + moved / MEMORY_BYTES_PER_US


class NodeCost:
    """The cost model for one node: its main output, its batch dims, and the cost of a placement choice."""

    def __init__(self, node: fx.Node, batch: BatchSymbols) -> None:
        self.node = node
        self.batch = batch
        vals = _tensor_leaves(node.meta.get("val"))
        sizes = [_numel(v) if v is not None else -1 for v in vals]
        self.main = max(range(len(vals)), key=lambda i: sizes[i]) if vals and max(sizes) >= 0 else None
        self.main_val = vals[self.main] if self.main is not None else None
        # mesh dim -> the dims of the main output the plan shards the batch over on it
        self.batch_dims: dict[int, set[int]] = batch.dims_of(self.main_val)
        self._compute: Optional[float] = None

    def main_spec(self, out: Any) -> Optional[DTensorSpec]:
        """The spec of the main output among ``out`` (an output spec, or a tuple of them)."""
        if isinstance(out, DTensorSpec):
            return out
        if isinstance(out, (tuple, list)) and self.main is not None and self.main < len(out):
            return out[self.main] if isinstance(out[self.main], DTensorSpec) else None
        return None

    def keeps_batch(self, out: Any) -> bool:
        """Whether output specs ``out`` shard the main output on a batch dim on every batch mesh dim."""
        spec = self.main_spec(out)
        if spec is None or self.main_val is None or not self.batch_dims:
            return False
        ndim = max(self.main_val.dim(), 1)
        return all(
            isinstance(spec.placements[m], Shard) and spec.placements[m].dim % ndim in dims
            for m, dims in self.batch_dims.items()
        )

    def compute_per_rank(self, out: Any) -> float:
        if self._compute is None:
            self._compute = compute_us(self.node)
        spec = self.main_spec(out)
        split = 1
        if spec is not None:
            for m, p in enumerate(spec.placements):
                if not isinstance(p, Replicate):
                    split *= spec.mesh.size(m)
        return self._compute / split

    def cost(self, current: list, wanted: list, out: Any) -> float:
        """Redistributing ``current`` input specs to ``wanted`` (DTensor's ``redistribute_cost``), plus
        the op's compute per rank with outputs ``out``."""
        from torch.distributed.tensor._collective_utils import redistribute_cost

        comm = sum(
            float(redistribute_cost(c, w)) for c, w in zip(current, wanted) if isinstance(c, DTensorSpec) and isinstance(w, DTensorSpec)
        )
        return comm + self.compute_per_rank(out)


class _Selector:
    """The cost-aware replacement for DTensor's ``_select_min_cost_strategy``, for one node."""

    def __init__(self, node: fx.Node, batch: BatchSymbols, dtensor_select) -> None:
        self.model = NodeCost(node, batch)
        self.dtensor_select = dtensor_select

    def cost(self, spec: OpSpec) -> float:
        comm = float(sum(chain.from_iterable(spec.redistribute_cost or [])))
        return comm + self.model.compute_per_rank(spec.output_specs)

    def __call__(self, strategy: OpStrategy, op_schema=None) -> OpSpec:
        chosen = self.dtensor_select(strategy, op_schema)
        if op_schema is None or not self.model.batch_dims or self.model.keeps_batch(chosen.output_specs):
            return chosen
        candidates = [chosen] + [s for s in strategy.strategies if s is not chosen and self.model.keeps_batch(s.output_specs)]
        costs = [self.cost(s) for s in candidates]
        best = min(range(len(candidates)), key=lambda i: costs[i])  # first minimum: ties keep DTensor's
        return candidates[best]


@contextlib.contextmanager
def choosing_by_cost(node: fx.Node, batch: BatchSymbols) -> Iterator[None]:
    """While DTensor propagates ``node``, pick its strategy with :class:`_Selector` (module docstring).

    Swaps ``_select_min_cost_strategy`` in DTensor's ``_sharding_prop`` module for the duration and
    restores it; use with ``propagate_op_sharding_non_cached`` (the cached entry point would return,
    or remember, choices made without this node's context).
    """
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop._select_min_cost_strategy
    _sharding_prop._select_min_cost_strategy = _Selector(node, batch, original)
    try:
        yield
    finally:
        _sharding_prop._select_min_cost_strategy = original
