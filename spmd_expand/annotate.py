"""Apply the plan to the global graph before propagation.

* :func:`output_placements`: the placements each graph output must end with.
* :func:`regions`: which forward or backward region of the step each node belongs to (passes use it,
  e.g. ``passes.regather``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .plans import ResolvedPlan
from .spec import AS_PRODUCED, replicate
from .trace import TracedStep, backward_index

__all__ = ["output_placements", "regions", "VIEW_OPS"]

aten = torch.ops.aten

# Ops whose output aliases their first argument: a backward use of `t(unshard(w))` is a use of the
# gathered parameter, so the view chain is re-made from the new gather too.
VIEW_OPS = frozenset(
    {
        aten.t.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.detach.default,
        aten.alias.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.slice.Tensor,
        aten.select.int,
    }
)


def output_placements(
    traced: TracedStep, model: nn.Module, mesh: DeviceMesh, plan: ResolvedPlan, gradient_sync: bool = True
) -> list:
    """Placements each graph output must end with: returns full, grads and new states per the plan.

    With ``gradient_sync=False`` gradients are left unreduced (``AS_PRODUCED``).
    """
    params = dict(model.named_parameters())
    result = []
    for role, node in zip(traced.outputs, traced.graph_module.graph.output_node().args[0]):
        if role.kind == "return":
            result.append(replicate(mesh))
        elif role.kind == "grad" and not gradient_sync:
            result.append(AS_PRODUCED)
        elif role.kind == "grad":
            result.append(plan.grad_placements(role.fqn, params[role.fqn]) or replicate(mesh))
        else:
            result.append(plan.state_placements(role.fqn, params[role.fqn], node.meta["val"]))
    return result


def regions(graph: fx.Graph) -> dict[fx.Node, tuple[str, int]]:
    """("fwd", k) for nodes after the k-th backward call (k=0: before any), ("bwd", k) inside it."""
    result, seen = {}, 0
    for node in graph.nodes:
        index = backward_index(node)
        if index is not None:
            seen = index
            result[node] = ("bwd", index)
        else:
            result[node] = ("fwd", seen)
    return result
