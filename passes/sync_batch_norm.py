"""``sync_batch_norm``: a training BatchNorm's statistics as sums over the batch, so each rank keeps its rows.

A BatchNorm in train mode normalizes with the mean and variance of the whole batch. DTensor has no
batch-sharded strategy for the fused batch-norm ops (``batch_norm_strategy`` and
``batch_norm_backward_strategy`` in ``torch/distributed/tensor/_ops/_math_ops.py`` keep the reduced
dims whole), so under a data-parallel plan each BatchNorm's input was all-gathered, forward and
backward: a ResNet-18 under DDP moved every BatchNorm's activations (and their gradients) between
the ranks on every step.

This global pass writes each training BatchNorm (``aten._native_batch_norm_legit_functional``,
``aten._native_batch_norm_legit.no_stats``) and its backward (``aten.native_batch_norm_backward``)
as the sums they are made of, which DTensor splits on the batch like any reduction (a sum over a
batch-sharded dim is ``Partial``; the elementwise ops after it all-reduce it first). Each rank then
normalizes its own rows with the global statistics, and the step communicates about what
``nn.SyncBatchNorm`` communicates (Ioffe & Szegedy 2015's statistics, synchronized as torch's
``SyncBatchNorm`` does), in one collective per direction: per BatchNorm, one all-reduce of the
per-channel sums of ``x`` and ``x^2`` forward (``2C`` float64) and one of the two per-channel sums of
the backward (``2C`` floats). (``nn.SyncBatchNorm`` all-gathers each rank's mean, variance and count
and combines them, Chan et al. 1979: W times the bytes, one round trip too.) A float64 model has no
wider type to accumulate in and takes two collectives forward (two passes, as below).

Arithmetic, per channel over the ``n = numel / C`` values of the reduced dims (batch and spatial):

* forward: ``mean = sum(x) / n``, ``var_sum = sum(x^2) - mean * sum(x)``, both sums accumulated in
  float64 (one pass, so one collective; its cancellation error, ~1e-16 x mean^2 / var relative, is
  below float32's rounding until |mean| / std passes ~3e4: against a float64 run, a float32 input of
  mean 100 and std 2 normalizes to 4e-7 here, 5e-7 by torch's two-pass CPU kernel); for a float64
  input two passes, as torch's CPU kernel: ``mean = sum(x) / n``, ``var_sum = sum((x - mean)^2)``;
  then ``rstd = rsqrt(var_sum / n + eps)``, ``y = (x - mean) * rstd * weight + bias``; running
  statistics ``(1 - momentum) * running + momentum * stat`` with the unbiased variance
  ``var_sum / (n - 1)``;
* backward (``native_batch_norm_backward`` in ``torch/_decomp/decompositions.py``):
  ``sum_dy = sum(dy)``, ``dot = sum(dy * (x - mean))``,
  ``dx = (dy - sum_dy / n - (x - mean) * dot / n * rstd^2) * rstd * weight``,
  ``dweight = dot * rstd``, ``dbias = sum_dy``.

Half-precision inputs compute in float32, as the fused kernels do. Results equal the fused op's up
to float rounding (a different summation order). Runs only under a plan that shards the batch
(``DDP``, ``FSDP``, ``HSDP``, the data-parallel dim of a 2-D plan); elsewhere the fused ops stay.
Disable it with ``spmd.compile(passes=spmd.default_passes(disable=["sync_batch_norm"]))``.

**Which BatchNorms** (``by_cost=True``, the default): a BatchNorm left fused has its input
all-gathered forward and its output gradient backward (DTensor's choice for a small activation);
rewritten, it all-reduces a few numbers per channel instead, as many times. For a tiny activation
the gather is as cheap (an all-reduce is two ring passes, an all-gather one), so each BatchNorm is
rewritten only where DTensor's own communication model (``redistribute_cost`` in
``torch/distributed/tensor/_collective_utils.py``, the model its sharding propagation chooses with)
says ``all_reduce(2C float64) + all_reduce(2C floats) < 2 * all_gather(input)`` (a float64 model:
``2 * all_reduce(C) + all_reduce(2C)`` on the left), over the data-parallel mesh dims at the traced
batch size. On 2 ranks the statistics win from a global float32 input of about 0.12 MB (8 images
of 64 channels of 8 x 8: 131 KB): an ImageNet ResNet's BatchNorms are all rewritten, a 16 x 16 toy's none. Either
choice gives the same results (the test suite runs both); the choice is made for the traced size
and holds for any batch size. ``SyncBatchNorm(by_cost=False)`` rewrites every training BatchNorm.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._prims_common import get_computation_dtype
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import PassError
from ..ops import LAYOUT
from ..spec import replicate, tensor_spec
from .manager import SpmdPass

__all__ = ["SyncBatchNorm", "statistics_are_cheaper", "sync_batch_norm"]

aten = torch.ops.aten

_FORWARD = aten._native_batch_norm_legit_functional.default
_FORWARD_NO_STATS = aten._native_batch_norm_legit.no_stats
_BACKWARD = aten.native_batch_norm_backward.default


def _reduced(x: torch.Tensor) -> tuple[list[int], Any, list[int]]:
    """(the dims a BatchNorm reduces over, their element count n, the shape that broadcasts a
    per-channel vector against ``x``)."""
    dims = [0, *range(2, x.dim())]
    n = 1
    for d in dims:
        n = n * x.shape[d]
    shape = [1] * x.dim()
    shape[1] = x.shape[1]
    return dims, n, shape


def _replicated(t: torch.Tensor, mesh_dims: Sequence[int]) -> torch.Tensor:
    """``t`` asked to be ``Replicate`` on each data-parallel mesh dim: a per-channel sum over the batch
    is all-reduced here, once, and everything computed from it is replicated (without the marker,
    DTensor would all-reduce it again for each later use, or all-gather the activation it meets)."""
    for mesh_dim in mesh_dims:
        t = LAYOUT(t, mesh_dim, "R")
    return t


def _one_pass(x: torch.Tensor) -> bool:
    """Whether ``x``'s statistics take one collective: accumulated in float64, wider than ``x``'s
    computation dtype (a float64 ``x`` has nothing wider; it takes two, as two passes)."""
    return get_computation_dtype(x.dtype) != torch.float64


def _statistics(x: torch.Tensor, eps: float, mesh_dims: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """``(mean, rstd, var_sum, n)`` of ``x`` per channel (keepdim shape, ``x``'s dtype): from one
    all-reduce of the float64 sums of ``x`` and ``x^2``, or for a float64 ``x`` from two (the sum,
    then the sum of squared deviations; module docstring)."""
    dims, n, _ = _reduced(x)
    if _one_pass(x):
        wide = x.to(torch.float64)
        sums = torch.stack([torch.sum(wide, dims, keepdim=True), torch.sum(wide * wide, dims, keepdim=True)])
        sums = _replicated(sums, mesh_dims)
        mean = sums[0] / n
        var_sum = torch.clamp(sums[1] - mean * sums[0], min=0.0)
        rstd = torch.rsqrt(var_sum / n + eps)
        return mean.to(x.dtype), rstd.to(x.dtype), var_sum.to(x.dtype), n
    mean = _replicated(torch.sum(x, dims, keepdim=True), mesh_dims) / n
    centered = x - mean
    var_sum = _replicated(torch.sum(centered * centered, dims, keepdim=True), mesh_dims)
    rstd = torch.rsqrt(var_sum / n + eps)
    return mean, rstd, var_sum, n


def _normalize(x, weight, bias, eps, mesh_dims):
    dims, _, shape = _reduced(x)
    acc = x.to(get_computation_dtype(x.dtype))
    mean, rstd, var_sum, n = _statistics(acc, eps, mesh_dims)
    # CPU's kernel keeps the statistics in the parameters' dtype (bfloat16 for a bfloat16 model) and
    # normalizes with those rounded values.
    saved = (weight if weight is not None else x).dtype
    mean, rstd = mean.to(saved).to(acc.dtype), rstd.to(saved).to(acc.dtype)
    out = (acc - mean) * rstd
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.to(x.dtype), mean.squeeze(dims), rstd.squeeze(dims), var_sum.squeeze(dims), n


def _forward(mesh_dims, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """``_native_batch_norm_legit_functional`` in train mode: (out, save_mean, save_rstd, new
    running_mean, new running_var)."""
    out, mean, rstd, var_sum, n = _normalize(x, weight, bias, eps, mesh_dims)
    # In the computation dtype, rounded once to the buffers' (as the fused kernel updates them).
    new_mean = running_mean.to(mean.dtype) * (1 - momentum) + mean * momentum
    new_var = running_var.to(mean.dtype) * (1 - momentum) + (var_sum / (n - 1)) * momentum
    return out, mean, rstd, new_mean, new_var


def _forward_no_stats(mesh_dims, x, weight, bias, training, momentum, eps):
    """``_native_batch_norm_legit.no_stats`` in train mode: (out, save_mean, save_rstd)."""
    out, mean, rstd, _, _ = _normalize(x, weight, bias, eps, mesh_dims)
    return out, mean, rstd


def _backward(mesh_dims, dy, x, weight, running_mean, running_var, save_mean, save_rstd, train, eps, output_mask):
    """``native_batch_norm_backward`` in train mode: (grad_input, grad_weight, grad_bias)."""
    dims, n, shape = _reduced(x)
    acc = get_computation_dtype(x.dtype)
    dy_acc, x_acc = dy.to(acc), x.to(acc)
    mean, rstd = save_mean.to(acc).reshape(shape), save_rstd.to(acc).reshape(shape)
    centered = x_acc - mean
    # Both sums in one all-reduce (they are ready together), as nn.SyncBatchNorm's backward sends them.
    sums = _replicated(torch.stack([torch.sum(dy_acc, dims), torch.sum(dy_acc * centered, dims)]), mesh_dims)
    sum_dy, dot = sums[0], sums[1]
    scale = rstd if weight is None else rstd * weight.to(acc).reshape(shape)
    projection = centered * ((dot / n).reshape(shape) * rstd * rstd)
    grad_input = ((dy_acc - projection) - (sum_dy / n).reshape(shape)) * scale
    weight_dtype = weight.dtype if weight is not None else x.dtype
    grad_weight = (dot * save_rstd.to(acc)).to(weight_dtype) if output_mask[1] else None
    grad_bias = sum_dy.to(weight_dtype) if output_mask[2] else None
    return grad_input.to(x.dtype), grad_weight, grad_bias


def _training(node: fx.Node) -> bool:
    if node.target is _FORWARD or node.target is _FORWARD_NO_STATS:
        return bool(node.args[5] if node.target is _FORWARD else node.args[3])
    return node.target is _BACKWARD and bool(node.args[7])


_DECOMPOSITIONS: dict[Any, Callable] = {_FORWARD: _forward, _FORWARD_NO_STATS: _forward_no_stats, _BACKWARD: _backward}


def _splice(graph: fx.Graph, node: fx.Node, fn: Callable) -> tuple[list[Optional[fx.Node]], list[fx.Node]]:
    """Trace ``fn`` over ``node``'s arguments (their fake values, symbolic sizes kept) and insert the
    traced ops before ``node``; returns the nodes of its results (None where it returns None) and
    every node inserted."""
    tensors = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]

    dtypes = [getattr(v, "dtype", None) for v in node.meta["val"]]

    def call(*values: Any) -> Any:
        args = list(node.args)
        for i, v in zip(tensors, values):
            args[i] = v
        # Each result in the fused op's dtype (CPU's kernel saves a bfloat16 input's statistics in
        # bfloat16, and its backward reads them so rounded).
        return [r if r is None else r.to(dtype) for r, dtype in zip(fn(*args), dtypes)]

    sub = make_fx(call, tracing_mode="symbolic")(*[node.args[i].meta["val"] for i in tensors])
    env: dict[fx.Node, Any] = {}
    inputs = iter(node.args[i] for i in tensors)
    results: list = []
    created: list[fx.Node] = []
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(inputs)
            elif n.op == "output":
                results = list(fx.node.map_arg(n.args[0], lambda a: env[a]))
            elif n.op == "call_function":
                new = graph.call_function(n.target, *fx.node.map_arg((n.args, n.kwargs), lambda a: env[a]))
                new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
                if "val" in n.meta:
                    new.meta["val"] = n.meta["val"]
                env[n] = new
                created.append(new)
            else:
                raise PassError(f"pass 'sync_batch_norm': the decomposition of {node.target} has a {n.op} node")
    return results, created


def _input(node: fx.Node) -> torch.Tensor:
    """The activation a batch-norm op normalizes (its fake value): the forward's input, the backward's
    saved input; the same tensor for a forward and its backward, so both get the same choice."""
    return node.args[1 if node.target is _BACKWARD else 0].meta["val"]


def statistics_are_cheaper(x: torch.Tensor, mesh: Any, mesh_dims: Sequence[int]) -> bool:
    """Whether all-reducing a BatchNorm's statistics costs less than all-gathering its input ``x``
    (global fake value, ``(N, C, ...)``) and its output gradient, split on dim 0 over ``mesh_dims``
    of ``mesh``, by DTensor's ``redistribute_cost`` (microseconds; module docstring)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._collective_utils import redistribute_cost

    def moved(val: torch.Tensor, placement: Any) -> float:
        """DTensor's cost of making ``val``, ``placement`` on ``mesh_dims``, replicated."""
        placements = [placement if m in mesh_dims else Replicate() for m in range(mesh.ndim)]
        return float(redistribute_cost(tensor_spec(mesh, placements, val), tensor_spec(mesh, replicate(mesh), val)))

    channels = x.shape[1]
    acc = get_computation_dtype(x.dtype)
    backward = moved(torch.empty((2, channels), dtype=acc, device="meta"), Partial())
    if _one_pass(x):
        forward = moved(torch.empty((2, channels), dtype=torch.float64, device="meta"), Partial())
    else:
        forward = 2 * moved(torch.empty((channels,), dtype=acc, device="meta"), Partial())
    return forward + backward < 2 * moved(x, Shard(0))


def sync_batch_norm(gm: fx.GraphModule, mesh_dims: Sequence[int], mesh: Any = None) -> int:
    """Write the training BatchNorm forwards and backwards of ``gm`` as their sums (module docstring),
    each sum asked to be ``Replicate`` on ``mesh_dims`` (the plan's data-parallel mesh dims): all of
    them, or with ``mesh`` given, those where :func:`statistics_are_cheaper`.

    Returns the number of ops rewritten. Idempotent: a second run finds none.
    """
    graph = gm.graph
    rewritten = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _DECOMPOSITIONS and _training(n)]:
        if mesh is not None and not statistics_are_cheaper(_input(node), mesh, mesh_dims):
            continue
        results, created = _splice(graph, node, functools.partial(_DECOMPOSITIONS[node.target], tuple(mesh_dims)))
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise PassError(f"pass 'sync_batch_norm': {user.name} reads {node.name}'s results as a whole")
            replacement = results[user.args[1]]
            if replacement is None:
                raise PassError(f"pass 'sync_batch_norm': {user.name} reads a result {node.name} does not compute")
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        graph.erase_node(node)
        for new in reversed(created):  # results nothing reads (an unused running statistic, a masked gradient)
            if not new.users:
                graph.erase_node(new)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


class SyncBatchNorm(SpmdPass):
    """Global pass: training BatchNorms as per-channel sums DTensor splits on the batch (see
    :mod:`.sync_batch_norm`); a no-op under a plan that does not shard the batch.

    Args:
        by_cost: rewrite a BatchNorm only where its statistics' all-reduces cost less than gathering
            its activations (:func:`statistics_are_cheaper`); False: every training BatchNorm.

    Ensures no training batch-norm op is left that the choice rewrites.
    """

    name = "sync_batch_norm"
    stage = "global"

    def __init__(self, by_cost: bool = True) -> None:
        super().__init__()
        self.by_cost = by_cost

    def _applies(self, gm: fx.GraphModule) -> bool:
        return bool(self.context(gm).plan.data_parallel_dims)

    def _mesh(self, gm: fx.GraphModule) -> Any:
        return self.context(gm).mesh if self.by_cost else None

    def call(self, gm: fx.GraphModule) -> PassResult:
        if not self._applies(gm):
            return PassResult(gm, False)
        dims = self.context(gm).plan.data_parallel_dims
        return PassResult(gm, sync_batch_norm(gm, dims, self._mesh(gm)) > 0)

    def ensures(self, gm: fx.GraphModule) -> None:
        if not self._applies(gm):
            return
        mesh, dims = self._mesh(gm), self.context(gm).plan.data_parallel_dims
        left = [
            n.name for n in gm.graph.nodes
            if n.op == "call_function" and n.target in _DECOMPOSITIONS and _training(n)
            and (mesh is None or statistics_are_cheaper(_input(n), mesh, dims))
        ]
        if left:
            raise PassError(f"pass 'sync_batch_norm': training batch-norm ops left: {left}")
