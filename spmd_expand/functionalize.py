"""Remove mutation from the traced autograd graph in one walk over its nodes, where that is exact.

Graph 1 of :func:`spmd_expand.trace.trace_step` writes tensors in place: the optimizer updates
parameters and states (``add_``, ``lerp_``, ``_foreach_mul_``), autograd accumulates gradients, models
call ``relu_``. The later stages need a functional graph: every node a value, and each written input
copied from its last value at the end (``aten.copy_(placeholder, value)``), as AOTAutograd does for
input mutations. torch's functionalization (``torch.func.functionalize`` under ``make_fx``) produces
it by running the whole graph again, a second symbolic trace that costs about as much as the first.

When every write is to a whole tensor and no view of a written tensor is read after the write,
removing the mutation needs no view replay, and :func:`functionalize_graph` does what torch's
functionalization does for such graphs without tracing again:

- an in-place op becomes its functional twin (``add_.Tensor`` -> ``add.Tensor``, ``copy_`` ->
  ``copy``, ``_foreach_mul_.List`` -> ``_foreach_mul.List``; batch norm's running-statistics update
  -> ``_native_batch_norm_legit_functional``), cast back to the written tensor's dtype where the
  twin promotes (``_to_copy``), and later reads of the written tensor (through the tensor, the op's
  result, or a ``detach``/``alias`` of it: aliases with the tensor's size, strides and offset) read
  that result;
- a fused optimizer kernel, which writes several tensor lists (``_fused_adamw_``: parameters, states),
  becomes its functional variant (``_fused_adamw``), which returns each written list anew; each
  written tensor then reads ``copy(tensor, new value)``, as the traced path records it
  (:class:`spmd_expand.trace._FunctionalizingInterpreter` copies the results back, and torch's
  functionalization turns those writes into ``copy``);
- each written placeholder gets ``aten.copy_(placeholder, last value)`` before the output, in
  placeholder order;
- ops in ``decompositions`` are decomposed as ``make_fx`` would (a small trace of that one op).

Anything else returns None, and the caller functionalizes by tracing: a write through a view other
than ``detach``/``alias`` (``x[:, 0] = v``, ``x[0].fill_(1)``), a view read after its base was
written, an op that writes an argument other than its first and is not a fused optimizer kernel
(``aten.div.out``), an in-place op without a functional twin of the same signature (``uniform_``), a
higher-order op.

Where the result differs from torch's re-trace (checked node by node in tests/test_functionalize.py
and, over the multi-rank test modules, by comparing both graphs of every compilation):

- a ``detach`` of a written tensor read after the write is not made again (torch regenerates the
  view; the walk reads the written value itself, which is the same tensor);
- an op torch's C++ functionalization decomposes through its own kernel before ``make_fx`` sees it
  (``binary_cross_entropy_with_logits``) is decomposed by ``decompositions`` here, as
  ``make_fx`` would without functionalization: other ops, the same function;
- where the shape env specialized a symbolic size while graph 1 was traced (a model that guards
  on the batch size), torch's re-trace writes the constant into every op; the walk keeps graph 1's
  sizes (symbolic before the guard, constant after). Both are sizes of the same tensors.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["functionalize_graph", "functional_twin", "list_functional_twin", "written_args", "written_values"]

aten = torch.ops.aten

# Views with the size, strides and storage offset of their input: a write through one is a write
# of the whole base tensor.
_WHOLE_ALIASES = frozenset({aten.detach.default, aten.alias.default})


# Ops that write arguments other than their first, with the functional op torch's functionalization
# uses for them: (functional op, {written argument: output with its new value}, outputs of the op).
_WRITES_TO_OUTPUTS = {
    aten._native_batch_norm_legit.default: (aten._native_batch_norm_legit_functional.default, {3: 3, 4: 4}, 3),
    aten._batch_norm_with_update.default: (aten._batch_norm_with_update_functional.default, {3: 4, 4: 5}, 4),
}


class _NeedsTracing(Exception):
    """The graph has a mutation this walk does not remove exactly."""


@functools.cache
def written_args(op: torch._ops.OpOverload) -> tuple[int, ...]:
    """Indices of the arguments ``op`` writes in place (``Tensor(a!)`` in its schema)."""
    return tuple(i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


# In-place ops that change a tensor's size, strides or storage, not only its values.
_METADATA_WRITES = ("resize", "set_", "as_strided", "swap")


def _unwritten_twin(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The op named like in-place ``op`` without its trailing ``_``, of the same overload and the same
    arguments (by name, type and keyword-only), that writes nothing; None when there is none."""
    name = op._opname
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(getattr(torch.ops, op.namespace), name[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload) or written_args(twin):
        return None
    ours, theirs = op._schema.arguments, twin._schema.arguments
    if len(ours) != len(theirs) or any(
        (a.name, str(a.type), a.kwarg_only) != (b.name, str(b.type), b.kwarg_only) for a, b in zip(ours, theirs)
    ):
        return None
    return twin


def written_values(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """The values ``op`` writes in place, from a call's ``args`` and ``kwargs`` (:func:`written_args`)."""
    arguments = op._schema.arguments
    return [args[i] if i < len(args) else kwargs[arguments[i].name] for i in written_args(op)]


@functools.cache
def functional_twin(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The functional op for in-place ``op`` that writes only its first argument: same name without
    the trailing ``_``, same overload, same arguments (by name, type and keyword-only), returning the
    new value (``Tensor``; ``Tensor[]`` for a list first argument). None when there is none, and for
    ops that change metadata (``t_``, ``resize_``, ``set_``) or draw random numbers (``uniform_``)."""
    if (
        written_args(op) != (0,)
        or any(word in op._opname for word in _METADATA_WRITES)
        or torch.Tag.inplace_view in op.tags
        or torch.Tag.nondeterministic_seeded in op.tags
    ):
        return None
    twin = _unwritten_twin(op)
    if twin is None:
        return None
    self_type = str(op._schema.arguments[0].type)
    returns = [str(r.type) for r in twin._schema.returns]
    if self_type == "Tensor" and returns == ["Tensor"] and len(op._schema.returns) == 1:
        return twin
    if self_type == "List[Tensor]" and returns == ["List[Tensor]"] and not op._schema.returns:
        return twin
    return None


@functools.cache
def list_functional_twin(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The functional op for in-place ``op`` that writes two or more tensor lists (the fused
    optimizer kernels, ``aten._fused_adamw_`` and its kind): same name without the trailing ``_``,
    same overload, same arguments, returning one ``Tensor[]`` per written argument, in their order
    (``self_out``, ``grads_out``, ...). None for anything else, including ops that write one list
    (``_foreach_copy_``: :func:`functional_twin`)."""
    written = written_args(op)
    ours = op._schema.arguments
    if len(written) < 2 or op._schema.returns or any(str(ours[i].type) != "List[Tensor]" for i in written):
        return None
    twin = _unwritten_twin(op)
    if twin is None:
        return None
    returns = [(r.name, str(r.type)) for r in twin._schema.returns]
    if returns != [(f"{ours[i].name}_out", "List[Tensor]") for i in written]:
        return None
    return twin


@functools.cache
def _aliased_arg(op: torch._ops.OpOverload) -> Optional[int]:
    """Index of the argument a view op's output aliases (None: the op returns fresh tensors)."""
    schema = op._schema
    sets = {s for r in schema.returns if r.alias_info is not None for s in r.alias_info.before_set}
    if not sets:
        return None
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and sets & set(a.alias_info.before_set):
            return i
    return -1  # an alias of no argument: not something this walk models


def _is_default(argument: torch._C.Argument, value: Any) -> bool:
    if not argument.has_default_value() or isinstance(value, (fx.Node, torch.Tensor, list, tuple)):
        return False
    default = argument.default_value
    return type(value) is type(default) and value == default


def _is_pure_python(target: Any) -> bool:
    # Symbolic-size arithmetic and tuple indexing that make_fx records (operator.mul, sym_max, ...).
    module = getattr(target, "__module__", None) or ""
    return module in ("_operator", "operator", "math", "builtins") or module.startswith("torch.fx.experimental") or (
        module == "torch" and getattr(target, "__name__", "").startswith("sym_")
    )


def functionalize_graph(
    gm: fx.GraphModule, decompositions: Mapping[Any, Callable], skip: Callable[[fx.Node], bool] = lambda n: False
) -> Optional[fx.GraphModule]:
    """``gm`` without mutation, or None where only torch's functionalization (a new trace) is exact.

    Args:
        gm: a ``make_fx`` graph whose nodes carry ``meta["val"]`` (fake tensors, symbolic sizes).
        decompositions: op -> decomposition, applied to the ops of the result as ``make_fx``'s
            ``decomposition_table`` would (a decomposition may return ``NotImplemented``).
        skip: nodes to leave out (they must have no users that are kept).

    Returns:
        A new graph module (``gm`` is not changed) whose nodes keep the metas of the nodes they come
        from; the functional twins and decomposed ops get fake values of their own. Dead nodes are
        left for the caller's dead-code elimination.
    """
    try:
        return _Walk(gm, decompositions, skip).run()
    except _NeedsTracing:
        return None


class _Walk:
    def __init__(self, gm: fx.GraphModule, decompositions: Mapping[Any, Callable], skip: Callable[[fx.Node], bool]):
        self.gm = gm
        self.decompositions = decompositions
        self.skip = skip
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}  # old node -> new node (or list of them)
        self.root: dict[fx.Node, fx.Node] = {}  # old node -> the old node that owns its storage
        self.created: dict[fx.Node, int] = {}  # old node -> position where it was made
        self.whole: set[fx.Node] = set()  # old nodes that are their root entire (itself, detach, in-place result)
        self.version: dict[fx.Node, Any] = {}  # old root -> new node with its current value
        self.last_write: dict[fx.Node, int] = {}  # old root -> position of its last write

    # -- reading values -------------------------------------------------------------------------------
    def value(self, node: fx.Node) -> Any:
        """The new-graph value of old ``node`` as read now."""
        root = self.root.get(node)
        if root is None:
            raise _NeedsTracing(f"{node.name}: read, but left out")
        if self.last_write.get(root, -1) <= self.created[node]:
            return self.env[node]  # not written since it was made
        if node in self.whole:
            return self.version[root]
        raise _NeedsTracing(f"{node.name}: a view read after its base was written")

    def args(self, node: fx.Node) -> tuple[tuple, dict]:
        return fx.node.map_arg((node.args, node.kwargs), self.value)

    # -- emitting nodes ---------------------------------------------------------------------------------
    def emit(self, old: fx.Node, target: Any, args: tuple, kwargs: dict, val: Any = None) -> Any:
        """A node ``target(*args, **kwargs)`` with ``old``'s meta, decomposed if the table says so."""
        if isinstance(target, torch._ops.OpOverload) and target in self.decompositions:
            return self.decompose(old, target, args, kwargs)
        new = self.create(target, args, kwargs)
        new.meta = dict(old.meta)
        if val is not None:
            new.meta["val"] = val
            new.meta.pop("tensor_meta", None)
        return new

    def create(self, target: Any, args: tuple, kwargs: dict) -> fx.Node:
        """A call node named and with arguments as ``make_fx`` records it: named after the op, and
        without keyword-only arguments that have their default value."""
        if not isinstance(target, torch._ops.OpOverload):
            return self.graph.create_node("call_function", target, args, kwargs)
        schema = target._schema.arguments
        args = list(args)
        while args and len(args) <= len(schema) and _is_default(schema[len(args) - 1], args[-1]):
            args.pop()
        by_name = {a.name: a for a in schema if a.kwarg_only}
        kwargs = {k: v for k, v in kwargs.items() if not (k in by_name and _is_default(by_name[k], v))}
        # make_fx names an op's node after its packet (``view``), a size query after its overload
        # (``sym_size_int``).
        packet = target.overloadpacket.__name__
        name = self.graph._target_to_str(target.__name__ if packet.startswith("sym_") else packet)
        return self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)

    def decompose(self, old: fx.Node, target: Any, args: tuple, kwargs: dict) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]

        def one_op(*values: Any) -> Any:
            leaves = list(flat)
            for i, v in zip(where, values):
                leaves[i] = v
            a, k = pytree.tree_unflatten(leaves, spec)
            return target(*a, **k)

        sub = make_fx(one_op, decomposition_table=self.decompositions, tracing_mode="symbolic")(
            *[flat[i].meta["val"] for i in where]
        )
        inputs = iter(flat[i] for i in where)
        local: dict[fx.Node, Any] = {}
        result: Any = None
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                local[n] = next(inputs)
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: local[a])
            elif n.op == "call_function":
                if isinstance(n.target, torch._ops.OpOverload) and written_args(n.target):
                    raise _NeedsTracing(f"{target}: its decomposition writes in place")
                new = self.create(n.target, *fx.node.map_arg((n.args, n.kwargs), lambda a: local[a]))
                new.meta = dict(old.meta)
                for key in ("val", "tensor_meta"):
                    new.meta.pop(key, None)
                    if key in n.meta:
                        new.meta[key] = n.meta[key]
                local[n] = new
            else:
                raise _NeedsTracing(f"{target}: its decomposition has a {n.op} node")
        return list(result) if isinstance(result, (list, tuple)) else result

    # -- one node ----------------------------------------------------------------------------------------
    def fresh(self, old: fx.Node, new: Any, at: int) -> None:
        self.env[old] = new
        self.root[old] = old
        self.created[old] = at
        self.whole.add(old)
        self.version[old] = new

    def write(self, old: fx.Node, at: int) -> None:
        op = old.target
        if op in _WRITES_TO_OUTPUTS:
            self.write_to_outputs(old, at)
            return
        lists_twin = list_functional_twin(op)
        if lists_twin is not None:
            self.write_lists(old, lists_twin, at)
            return
        twin = functional_twin(op)
        if twin is None:
            raise _NeedsTracing(f"{op}: no functional twin")
        written = old.args[0]
        targets = list(written) if isinstance(written, (list, tuple)) else [written]
        self.check_writable(op, targets)
        args, kwargs = self.args(old)
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        new = self.emit(old, twin, args, kwargs, val=twin(*fake_args, **fake_kwargs))
        if isinstance(written, (list, tuple)):
            items = new if isinstance(new, list) else [self.getitem(old, new, i) for i in range(len(targets))]
            for t, item in zip(targets, items):
                self.version[self.root[t]] = self.as_written(old, item, t)
                self.last_write[self.root[t]] = at
            self.env[old] = None
            return
        root = self.root[written]
        new = self.as_written(old, new, written)
        self.version[root] = new
        self.last_write[root] = at
        # The in-place op's result is its first argument: it reads the root's value when used.
        self.env[old] = new
        self.root[old] = root
        self.created[old] = at
        self.whole.add(old)

    def check_writable(self, op: Any, targets: list) -> None:
        """Each of ``targets`` is a whole tensor (not a view of one) that is not a constant."""
        for t in targets:
            if not isinstance(t, fx.Node) or t not in self.whole:
                raise _NeedsTracing(f"{op}: writes a view")
            if self.root[t].op == "get_attr":
                raise _NeedsTracing(f"{op}: writes a constant")

    def as_written(self, old: fx.Node, value: fx.Node, written: fx.Node) -> fx.Node:
        """``value`` (a functional result) as the in-place op leaves it in ``written``: in its dtype
        (``p.add_(float64)`` keeps ``p`` float32; the functional ``add`` promotes), as torch's
        functionalization does with a ``_to_copy``. Another shape is left to torch."""
        val, target = value.meta.get("val"), written.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(target, torch.Tensor):
            raise _NeedsTracing(f"{old.target}: no fake value to check the result against")
        if val.shape != target.shape:
            raise _NeedsTracing(f"{old.target}: a result of another shape than the tensor it writes")
        if val.dtype == target.dtype:
            return value
        kwargs = {"dtype": target.dtype, "layout": torch.strided}
        return self.emit(old, aten._to_copy.default, (value,), kwargs, val=aten._to_copy.default(val, **kwargs))

    def write_to_outputs(self, old: fx.Node, at: int) -> None:
        functional, outputs, kept = _WRITES_TO_OUTPUTS[old.target]
        if old.kwargs:
            raise _NeedsTracing(f"{old.target}: keyword arguments")
        for i in outputs:
            if not isinstance(old.args[i], fx.Node) or old.args[i] not in self.whole:
                raise _NeedsTracing(f"{old.target}: writes a view")
        args, kwargs = self.args(old)
        fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
        new = self.emit(old, functional, args, kwargs, val=functional(*fake_args))
        items = new if isinstance(new, list) else [self.getitem(old, new, i) for i in range(len(new.meta["val"]))]
        for arg_index, out_index in outputs.items():
            root = self.root[old.args[arg_index]]
            self.version[root] = self.as_written(old, items[out_index], old.args[arg_index])
            self.last_write[root] = at
        self.env[old] = items[:kept]

    def write_lists(self, old: fx.Node, twin: torch._ops.OpOverload, at: int) -> None:
        """An op that writes several tensor lists (a fused optimizer step): its functional twin returns
        the new value of each written list, in argument order."""
        lists = written_values(old.target, old.args, old.kwargs)
        for targets in lists:
            if not isinstance(targets, (list, tuple)):
                raise _NeedsTracing(f"{old.target}: writes a list it is not given as a list")
            self.check_writable(old.target, targets)
        args, kwargs = self.args(old)
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        new = self.emit(old, twin, args, kwargs, val=twin(*fake_args, **fake_kwargs))
        if isinstance(new, (list, tuple)):
            raise _NeedsTracing(f"{old.target}: decomposed")
        for k, (targets, before) in enumerate(zip(lists, written_values(old.target, args, kwargs))):
            out = self.getitem(old, new, k)
            for i, (t, current) in enumerate(zip(targets, before)):
                # As torch's functionalization writes a mutable op's results back: copy(input, result),
                # the result in the written tensor's shape and dtype.
                item = self.getitem(old, out, i)
                fake = aten.copy.default(current.meta["val"], item.meta["val"])
                self.version[self.root[t]] = self.emit(old, aten.copy.default, (current, item), {}, val=fake)
                self.last_write[self.root[t]] = at
        self.env[old] = None

    def getitem(self, old: fx.Node, source: fx.Node, i: int) -> fx.Node:
        item = self.graph.create_node("call_function", operator.getitem, (source, i))
        item.meta = dict(old.meta)
        item.meta["val"] = source.meta["val"][i]
        item.meta.pop("tensor_meta", None)
        return item

    def node(self, old: fx.Node, at: int) -> None:
        if old.op == "placeholder":
            new = self.graph.placeholder(old.target)
            new.meta = dict(old.meta)
            self.fresh(old, new, at)
            return
        if old.op == "get_attr":
            new = self.graph.get_attr(old.target)
            new.meta = dict(old.meta)
            self.fresh(old, new, at)
            return
        if old.op != "call_function":
            raise _NeedsTracing(f"a {old.op} node")
        target = old.target
        if target is operator.getitem and isinstance(self.env.get(old.args[0]), list):
            self.fresh(old, self.env[old.args[0]][old.args[1]], at)  # an item of a decomposed op's results
            return
        if target is operator.getitem and old.args[0] in self.root and old.args[0] not in self.whole:
            # An item of a multi-output view (split, unbind): a view of the same base, made with it.
            source = old.args[0]
            new = self.emit(old, target, *self.args(old))
            self.env[old], self.root[old], self.created[old] = new, self.root[source], self.created[source]
            return
        if not isinstance(target, torch._ops.OpOverload):
            if isinstance(target, torch._ops.OperatorBase) or not _is_pure_python(target):
                raise _NeedsTracing(f"{target}: not an aten op")
            self.fresh(old, self.emit(old, target, *self.args(old)), at)
            return
        schema = target._schema
        if written_args(target):
            self.write(old, at)
            return
        aliased = _aliased_arg(target)
        if aliased == -1:
            raise _NeedsTracing(f"{target}: an output that aliases no argument")
        new = self.emit(old, target, *self.args(old))
        if aliased is None:
            self.fresh(old, new, at)
            return
        base = old.args[aliased] if aliased < len(old.args) else old.kwargs.get(schema.arguments[aliased].name)
        if not isinstance(base, fx.Node) or isinstance(new, list):
            raise _NeedsTracing(f"{target}: a view of a list or of a decomposed op")
        self.env[old], self.root[old], self.created[old] = new, self.root[base], at
        if target in _WHOLE_ALIASES and base in self.whole:
            self.whole.add(old)
        # A multi-output view (split, unbind) is a view of the base here; its items are read through
        # operator.getitem (above).

    def run(self) -> fx.GraphModule:
        placeholders = []
        output = None
        for at, old in enumerate(self.gm.graph.nodes):
            if old.op == "output":
                output = old
                break
            if self.skip(old):
                continue
            self.node(old, at)
            if old.op == "placeholder":
                placeholders.append(old)
        assert output is not None
        result = fx.node.map_arg(output.args[0], self.value)
        for p in placeholders:
            if self.version[p] is not self.env[p]:
                copy = self.graph.create_node("call_function", aten.copy_.default, (self.env[p], self.version[p]))
                copy.meta["val"] = p.meta.get("val")
        out = self.graph.output(result)
        out.meta = dict(output.meta)
        gm = _make_graph_module(self.gm, self.graph)
        gm.meta.update(self.gm.meta)
        return gm
