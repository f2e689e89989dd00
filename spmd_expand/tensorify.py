"""Hyperparameters as tensors for Inductor: a float graph input must stay an input, not a constant.

The traced step takes every float setting of the optimizer's param groups (``lr``, ``betas``,
``weight_decay``, ``eps``, ...) as a Python-float graph input, so that an LR scheduler needs no new
graph. Inductor (torch 2.13) does not keep a float input: AOTAutograd passes non-tensor inputs through
as constants (``process_inputs``), so the code it generates holds the value seen at compile time, and
calling it with another learning rate silently trains with the old one.

:func:`tensorify_float_inputs` rewrites the graph handed to Inductor so that each float input is a 0-d
float64 tensor instead (the runner converts the Python float on every call): the scalar arithmetic the
optimizer did on it (``1 - lr * weight_decay``, ``beta1 ** step``) becomes float64 tensor arithmetic, as
exact as Python's, and each ATen op that took it as a Scalar takes the Tensor form instead, with the
value cast to the operand's dtype first, as the op casts a Scalar. Torch's own version of this rewrite
is Dynamo's ``specialize_float=False`` path (``torch.fx.passes._tensorify_python_scalars``), which needs
Dynamo's symbolic floats and restarts; this one works on our graphs and refuses rather than guesses:
when a use is not in its table, nothing is rewritten and the caller keeps the values as constants and
recompiles when they change (:class:`spmd_expand.lower.InductorStep`).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

__all__ = ["tensorify_float_inputs"]

aten = torch.ops.aten

# Python arithmetic on floats (SymFloat nodes of the trace) -> float64 tensor arithmetic.
_SCALAR_OPS: dict[Callable, Callable] = {
    operator.add: aten.add.Tensor,
    operator.sub: aten.sub.Tensor,
    operator.mul: aten.mul.Tensor,
    operator.truediv: aten.div.Tensor,
    operator.pow: aten.pow.Tensor_Tensor,
    operator.neg: aten.neg.default,
    math.sqrt: aten.sqrt.default,
}
# Element-wise ATen ops with a Tensor overload for a Scalar operand (``other``).
_BINARY = {
    aten.add.Tensor: aten.add.Tensor,
    aten.sub.Tensor: aten.sub.Tensor,
    aten.mul.Tensor: aten.mul.Tensor,
    aten.div.Tensor: aten.div.Tensor,
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Scalar: aten.div.Tensor,
}
# Ops whose kernels round a Scalar operand to a 16-bit tensor's dtype before computing in float32
# (add/sub take it as a wrapped tensor of the common dtype; so do pow and every ``alpha``); mul, div,
# lerp and addcmul/addcdiv take it unrounded. Checked against eager on bfloat16 (tests/test_lowering.py).
_ROUNDS_SCALAR = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar})
# Foreach ops over lists, with a Scalar taken by every element: written per element.
_FOREACH = {
    aten._foreach_add.Scalar: "add",
    aten._foreach_sub.Scalar: "sub",
    aten._foreach_mul.Scalar: "mul",
    aten._foreach_div.Scalar: "div",
    aten._foreach_lerp.Scalar: "lerp",
    aten._foreach_addcmul.Scalar: "addcmul",
    aten._foreach_addcdiv.Scalar: "addcdiv",
    aten._foreach_add.List: "add_list",  # x + alpha * y
    aten._foreach_sub.List: "sub_list",
}


def tensorify_float_inputs(gm: fx.GraphModule, positions: list[int]) -> Optional[fx.Node]:
    """Make the placeholders of ``gm`` at ``positions`` (float inputs) take 0-d float64 tensors.

    Rewrites ``gm`` in place and returns None; or returns the first node that uses those inputs in a way
    this rewrite does not know, and leaves ``gm`` as it was (the inputs then stay floats).
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    roots = {placeholders[i] for i in positions}
    derived = _derived_scalars(gm, roots)
    if isinstance(derived, fx.Node):
        return derived
    rewrite = _Rewrite(gm.graph, roots | derived)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (node in derived or any(a in rewrite.scalars for a in _operands(node))):
            rewrite(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return None


def _operands(node: fx.Node) -> list[Any]:
    flat: list[Any] = []
    for a in (*node.args, *node.kwargs.values()):
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def _derived_scalars(gm: fx.GraphModule, roots: set[fx.Node]) -> "set[fx.Node] | fx.Node":
    """The scalar nodes computed from ``roots``; or the first node that uses one in a way not supported."""
    scalars = set(roots)
    derived: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not any(a in scalars for a in _operands(node)):
            continue
        if node.target in _SCALAR_OPS:
            scalars.add(node)
            derived.add(node)
        elif not _supported_use(node, scalars):
            return node
    for node in scalars:
        for user in node.users:
            if user.op == "output":
                return user
    return derived


def _bound(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults included."""
    values = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    return values


_HALF = (torch.bfloat16, torch.float16)


def _is_half(value: Any) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor) and value.meta["val"].dtype in _HALF


def _is_tensor(value: Any, scalars: set[fx.Node]) -> bool:
    return isinstance(value, fx.Node) and value not in scalars and isinstance(value.meta.get("val"), torch.Tensor)


def _supported_use(node: fx.Node, scalars: set[fx.Node]) -> bool:
    target, args, kwargs = node.target, node.args, node.kwargs
    if target in _BINARY:
        return _is_tensor(args[0], scalars) and set(kwargs) <= {"alpha"}
    if target is aten.pow.Scalar:
        return args[0] in scalars and _is_tensor(args[1], scalars)
    if target is aten.pow.Tensor_Scalar:
        return _is_tensor(args[0], scalars) and args[1] in scalars
    if target is aten.scalar_tensor.default:
        return args[0] in scalars and set(kwargs) <= {"dtype", "device"}
    if target is aten.lerp.Scalar:
        return _is_tensor(args[0], scalars) and _is_tensor(args[1], scalars)
    if target in (aten.addcmul.default, aten.addcdiv.default):
        return all(_is_tensor(a, scalars) for a in args[:3])
    if target in _FOREACH:
        lists_ok = not any(x in scalars for a in args if isinstance(a, (list, tuple)) for x in a)
        return lists_ok and all(u.target is operator.getitem for u in node.users)
    return False


class _Rewrite:
    """Rewrites one node at a time, in graph order; ``tensor[n]`` is the 0-d float64 tensor node of
    scalar node ``n`` (a rewritten placeholder is its own tensor)."""

    def __init__(self, graph: fx.Graph, scalars: set[fx.Node]):
        self.graph = graph
        self.scalars = scalars
        self.tensor: dict[fx.Node, fx.Node] = {n: n for n in scalars if n.op == "placeholder"}

    def call(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def as_tensor(self, value: Any) -> fx.Node:
        if isinstance(value, fx.Node):
            return self.tensor[value]
        return self.call(aten.scalar_tensor.default, value, dtype=torch.float64)

    def like(self, value: Any, operand: fx.Node, rounds: bool = False) -> Any:
        """``value`` cast to the dtype an op on ``operand`` computes in, as the op casts a Scalar: the
        operand's own dtype, float32 for bfloat16/float16, whose ops compute in float32. Whether the
        Scalar is first rounded to the 16-bit dtype depends on the ATen kernel (``rounds``, see
        :data:`_ROUNDS_SCALAR`): ``mul``/``div``/``lerp``/``addcmul`` keep it unrounded (a bf16 0-d
        tensor would round AdamW's beta1 0.9 to 0.8984), ``add``/``sub``/``pow`` and every ``alpha``
        round it. A 16-bit tensor operand is upcast (:meth:`up`); numbers are returned as they are."""
        if not isinstance(value, fx.Node):
            return value
        if value not in self.scalars:
            return self.up(value)
        dtype = operand.meta["val"].dtype
        tensor = self.tensor[value]
        if dtype in _HALF:
            if rounds:
                tensor = self.call(aten._to_copy.default, tensor, dtype=dtype)
            dtype = torch.float32
        elif not dtype.is_floating_point and not dtype.is_complex:
            dtype = torch.get_default_dtype()
        return self.call(aten._to_copy.default, tensor, dtype=dtype)

    def up(self, value: Any) -> Any:
        """A bfloat16/float16 tensor node as float32 (what the op computes in); anything else as is."""
        if not _is_half(value):
            return value
        return self.call(aten._to_copy.default, value, dtype=torch.float32)

    def down(self, result: fx.Node, like: fx.Node) -> fx.Node:
        """``result`` rounded once to the dtype of the node it replaces, when that has 16 bits."""
        if not _is_half(like):
            return result
        return self.call(aten._to_copy.default, result, dtype=like.meta["val"].dtype)

    def __call__(self, node: fx.Node) -> None:
        target, args, kwargs = node.target, node.args, node.kwargs
        with self.graph.inserting_before(node):
            if target in _SCALAR_OPS:
                self.tensor[node] = self.call(_SCALAR_OPS[target], *(self.as_tensor(a) for a in args))
                return
            if target in _BINARY:
                rounds = target in _ROUNDS_SCALAR
                x, other, alpha = self.up(args[0]), self.like(args[1], args[0], rounds), kwargs.get("alpha", 1)
                if isinstance(alpha, fx.Node) and alpha in self.scalars:
                    # x + alpha * other, the op's own order
                    other = self.call(aten.mul.Tensor, self.like(alpha, args[0], rounds=True), other)
                    alpha = 1
                new = self.call(_BINARY[target], x, other, **({"alpha": alpha} if alpha != 1 else {}))
            elif target is aten.pow.Scalar:
                new = self.call(aten.pow.Tensor_Tensor, self.like(args[0], args[1], rounds=True), self.up(args[1]))
            elif target is aten.pow.Tensor_Scalar:
                new = self.call(aten.pow.Tensor_Tensor, self.up(args[0]), self.like(args[1], args[0], rounds=True))
            elif target is aten.scalar_tensor.default:
                new = self.call(
                    aten._to_copy.default, self.tensor[args[0]], dtype=kwargs.get("dtype") or torch.get_default_dtype(), device=kwargs.get("device")
                )
            elif target is aten.lerp.Scalar:
                new = self.call(aten.lerp.Tensor, self.up(args[0]), self.up(args[1]), self.like(args[2], args[0]))
            elif target in (aten.addcmul.default, aten.addcdiv.default):
                new = self._addc("addcmul" if target is aten.addcmul.default else "addcdiv", *args[:3], kwargs.get("value", 1))
            else:  # _FOREACH
                self._foreach(node)
                return
            if target is not aten.scalar_tensor.default:
                new = self.down(new, node)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)

    def _addc(self, kind: str, x: fx.Node, t1: fx.Node, t2: fx.Node, value: Any) -> fx.Node:
        """``x + value * (t1 * t2)`` or ``x + value * (t1 / t2)``."""
        product = self.call(aten.mul.Tensor if kind == "addcmul" else aten.div.Tensor, self.up(t1), self.up(t2))
        return self.call(aten.add.Tensor, self.up(x), self.call(aten.mul.Tensor, product, self.like(value, x)))

    def _foreach(self, node: fx.Node) -> None:
        kind = _FOREACH[node.target]
        bound = _bound(node)
        scalar = bound[{"lerp": "weight", "addcmul": "value", "addcdiv": "value", "add_list": "alpha", "sub_list": "alpha"}.get(kind, "scalar")]
        lists = [a for a in node.args if isinstance(a, (list, tuple))]
        results = []
        for elements in zip(*lists):
            x = elements[0]
            if kind == "lerp":
                result = self.call(aten.lerp.Tensor, self.up(x), self.up(elements[1]), self.like(scalar, x))
            elif kind in ("addcmul", "addcdiv"):
                result = self._addc(kind, x, elements[1], elements[2], scalar)
            elif kind in ("add_list", "sub_list"):  # x + alpha * y
                scaled = self.call(aten.mul.Tensor, self.like(scalar, x, rounds=True), self.up(elements[1]))
                result = self.call(aten.add.Tensor if kind == "add_list" else aten.sub.Tensor, self.up(x), scaled)
            else:
                result = self.call(getattr(aten, kind).Tensor, self.up(x), self.like(scalar, x, rounds=kind in ("add", "sub")))
            results.append(self.down(result, x))
        for user in list(node.users):
            results[user.args[1]].meta.update(user.meta)
            user.replace_all_uses_with(results[user.args[1]])
            self.graph.erase_node(user)
        self.graph.erase_node(node)
