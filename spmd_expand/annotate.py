"""Apply the plan to the global graph before propagation.

* :func:`output_placements`: the placements each graph output must end with.
* :func:`regather_for_backward`: for ``reshard_after_forward``, give every region of the step after the
  first (each backward, and the forward of each later micro-batch) its own copy of a parameter's
  ``unshard`` marker, so the gathered parameter is not kept alive from forward into backward and is
  gathered again where it is needed (what FSDP does with ``reshard_after_forward=True``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .ops import UNSHARD
from .plans import ResolvedPlan
from .spec import AS_PRODUCED, replicate
from .trace import TracedStep, backward_index

__all__ = ["output_placements", "regather_for_backward"]

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


def _regions(graph: fx.Graph) -> dict[fx.Node, tuple[str, int]]:
    """("fwd", k) for nodes after the k-th backward call (k=0: before any), ("bwd", k) inside it."""
    regions, seen = {}, 0
    for node in graph.nodes:
        index = backward_index(node)
        if index is not None:
            seen = index
            regions[node] = ("bwd", index)
        else:
            regions[node] = ("fwd", seen)
    return regions


def regather_for_backward(gm: fx.GraphModule) -> int:
    """Give each region after the first its own ``unshard`` of every parameter it reads.

    Returns the number of ``unshard`` markers added. Idempotent: a second run adds none.
    """
    graph = gm.graph
    regions = _regions(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    added = 0
    for marker in [n for n in graph.nodes if n.target is UNSHARD]:
        closure = [marker]
        for node in closure:  # grows while iterating: the marker's view chain, in graph order
            closure.extend(u for u in node.users if u.target in VIEW_OPS and u.args[0] is node)
        members = set(closure)
        home = regions[marker]
        uses: dict[tuple[str, int], list[tuple[fx.Node, fx.Node]]] = {}
        for value in closure:
            for user in value.users:
                if user not in members and regions[user] != home:
                    uses.setdefault(regions[user], []).append((value, user))
        for region, pairs in uses.items():
            first = min((user for _, user in pairs), key=order.__getitem__)
            copies: dict[fx.Node, fx.Node] = {}

            def copy(value: fx.Node) -> fx.Node:
                if value not in copies:
                    args = value.args if value is marker else (copy(value.args[0]), *value.args[1:])
                    new = graph.call_function(value.target, args, value.kwargs)
                    new.meta = dict(value.meta)
                    copies[value] = new
                return copies[value]

            with graph.inserting_before(first):
                for value, user in pairs:
                    user.replace_input_with(value, copy(value))
            added += 1
    if added:
        graph.lint()
        gm.recompile()
    return added
