"""Python values a traced step read, checked on every call: a compiled graph bakes them in.

``make_fx`` runs the step's Python once. Every Python number, string or flag it reads on the way
(a module's ``self.p`` or ``self.temperature``, a global ``ALPHA``, a closure's ``scale``) becomes a
constant of the graph or chooses a code path, and the graph would keep that value when the user
changes it between steps: a silent wrong answer. So every such value is recorded at trace time and
compared on every call (:meth:`PythonGuards.check`); a changed value compiles the step again (with a
warning that names it), as ``torch.compile`` recompiles when a global or an attribute it guarded on
changes (Dynamo's ``GlobalSource`` / ``AttrSource`` guards).

What is recorded:

* **module attributes**, exactly those read: while the step is traced, every module of the model is
  given a subclass of its class (same name) whose ``__getattribute__`` notes each attribute read whose
  value is a Python scalar (``bool``, ``int``, ``float``, ``complex``, ``str``, ``None``,
  ``torch.dtype``, ``torch.device``, or a tuple, list or dict of those, copied). ``nn.Module``'s own bookkeeping
  (``training``, hooks) is left out: :func:`spmd_expand.guards.snapshot` covers it;
* **globals and closure variables**, by reading the code: the names the step function loads as
  globals or from closure cells (``LOAD_GLOBAL`` / ``LOAD_DEREF``), in its nested functions, in the
  Python functions it reaches that way, and in the ``forward`` of each module class, whose values are
  such scalars; library code (torch, site-packages) is not followed. A ``float`` there that no
  followed code assigns is a graph input instead (:func:`float_places`,
  :class:`spmd_expand.trace.FloatConstant`), unless tracing with it as one failed;
* **attributes of settings objects**, exactly those read: a HuggingFace ``config`` a module holds
  (``self.config.output_hidden_states``), an ``argparse.Namespace``, dataclass or ``SimpleNamespace``
  a global or closure variable holds (``cfg.label_smoothing``), the object a bound-method step
  belongs to (``self.alpha`` of a trainer's ``train_step``): each gets a recording subclass while
  the step is traced, as modules do (:func:`is_settings_object` says which objects; one whose class
  refuses it has every scalar attribute it holds recorded).

torch's global state (autocast, default dtype, ...) is compared too, with torch's own
``GlobalStateGuard`` (:class:`GlobalState`): a step traced under ``torch.autocast`` is not reused
outside it.

Not recorded: values read through ``__dict__``, and attributes of objects reached in other ways
(an element of a list of configs, an object of torch's). Tensors are never baked: a tensor the step
reads must be an input (:func:`spmd_expand.trace.trace_step` refuses the rest).

Python state the step *writes* is the other half (:class:`StateWatch`): the step's Python runs when
it is traced, not on every call, so ``LOSSES.append(loss)`` or ``STATS["n"] += 1`` would happen once,
and a tensor kept that way would be a placeholder of the trace. The state the step can reach (the
containers and user objects its globals and closure variables hold, the variables it assigns, the
plain attributes of the model's modules) is snapshotted before the trace and compared after;
:func:`spmd_expand.trace._settle_state_changes` refuses, undoes or reports each change.
:func:`code_writes` finds assignments to globals and closure variables in the code itself, :func:`code_prints`
calls of `print` (both run once, when the step is traced: warned about).
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import contextlib
import copy
import dis
import enum
import functools
import itertools
import operator
import os
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import optimizer_state
from .errors import in_torch_or_spmd_expand

__all__ = [
    "GlobalState",
    "HeldModules",
    "ModuleRead",
    "PythonGuards",
    "PythonValue",
    "RandomStateUse",
    "RecordedReads",
    "StateChange",
    "StateWatch",
    "code_reads",
    "code_prints",
    "code_writes",
    "called_methods",
    "forward_functions",
    "hook_functions",
    "hooks",
    "MODULE_HOOKS",
    "TENSOR_HOOKS",
    "is_settings_object",
    "record_reads",
    "settings_variables",
    "TensorConstant",
    "float_places",
    "liftable",
    "tensor_constants",
]

_SCALAR_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
class _Missing:
    """What a read of an attribute or variable that does not exist gives (``getattr(self, "scale",
    1.0)`` while ``scale`` is unset): a value like any other, so that setting it later is a change."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _numpy_type(value: Any, name: str) -> bool:
    """Whether ``value`` is an instance of numpy's ``name`` (``generic``: a numpy scalar; ``ndarray``),
    without importing numpy where the program did not."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, getattr(numpy, name))


def is_scalar(value: Any) -> bool:
    """Whether ``value`` is a Python value a trace bakes in and this module compares by value: a
    scalar (a numpy scalar too: ``np.float32(0.5)``, ``np.exp(-k)``; an ``Enum`` member, a ``range``),
    or a tuple, list, set, frozenset or dict of them (also subclasses: a named tuple, an
    ``OrderedDict``, a ``defaultdict``; dict keys of any of these kinds: ``{0: 1.0}``)."""
    kind = type(value)
    if kind in _SCALAR_TYPES or kind is range or _numpy_type(value, "generic") or isinstance(value, enum.Enum):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(is_scalar(v) for v in value)
    if isinstance(value, dict):
        return all(is_scalar(k) and is_scalar(v) for k, v in value.items())
    return False


# Functions a trace runs, compared by identity: a global, closure variable, default argument or
# instance attribute holding one (``LOSS = focal``, ``self.act = torch.tanh``) can be given another.
_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


def is_guarded(value: Any) -> bool:
    """Whether a read of ``value`` is guarded: a scalar (:func:`is_scalar`, by value), a function or a
    numpy array (by identity: the graph holds the array's memory, so writes into it reach the graph,
    another array would not). Not a bound method: one is made on every attribute read of a method."""
    return is_scalar(value) or isinstance(value, _FUNCTION_TYPES) or _numpy_type(value, "ndarray")


def _frozen(value: Any) -> Any:
    """A copy of a value :func:`is_scalar` accepts that later in-place changes of it cannot reach."""
    if type(value) is list:
        return [_frozen(v) for v in value]
    if type(value) is tuple:
        return tuple(_frozen(v) for v in value)
    if type(value) is set:
        return set(value)
    if isinstance(value, dict):  # of its own type: an OrderedDict or a defaultdict compares as one
        copied = copy.copy(value)
        copied.update((k, _frozen(v)) for k, v in value.items())
        return copied
    if isinstance(value, list):
        return copy.copy(value)
    return value


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and not _numpy_type(a, "ndarray") and bool(a == b))


@dataclass(frozen=True)
class PythonValue:
    """One recorded read: ``description`` names it (``"attribute drop.p of the model"``), ``read()``
    returns its current value (``_MISSING`` when it is gone), ``value`` is the traced one."""

    description: str
    read: Callable[[], Any]
    value: Any


class GlobalState:
    """torch's global state a trace ran under (autocast per device type and its dtype, default dtype,
    deterministic algorithms, TF32/reduced-precision matmul flags, intra-op threads): torch's own
    ``torch._C._dynamo.guards.GlobalStateGuard``, the check behind Dynamo's global-state guard. Grad
    mode is taken as off on both sides (the compiled step sets it itself). Also the torch function and
    dispatch modes and the saved-tensor hooks active around the call (:func:`_active_modes`)."""

    def __init__(self) -> None:
        with torch.no_grad():
            self._guard = torch._C._dynamo.guards.GlobalStateGuard()
        self._modes = _active_modes()

    def reason(self) -> Optional[str]:
        """None when the current state is the traced one, else what differs (torch's words)."""
        with torch.no_grad():
            if self._guard.check():
                # The trace ran the step through the modes and hooks around it.
                return None if _active_modes() == self._modes else "function modes, dispatch modes or saved-tensor hooks"
            return self._guard.reason().strip() or "global state"


def _active_modes() -> tuple:
    """The ``TorchFunctionMode``s and ``TorchDispatchMode``s on torch's stacks and the innermost
    ``saved_tensors_hooks`` now, by identity (Dynamo guards its function-mode stack the same way)."""
    return (
        tuple(_get_current_function_mode_stack()),
        tuple(_get_current_dispatch_mode_stack()),
        torch._C._autograd._top_saved_tensors_default_hooks(True),
    )


class CodeIdentity:
    """Which code a traced step ran, checked on every call: the graph is that code's, so a method or
    ``forward`` replaced afterwards (``model.forward = ...``, ``Net.forward = ...``, ``model.act = fn``
    shadowing a method, ``self.fn = other.method``, ``f.__code__ = ...``, ``optimizer.step = wrapper``)
    must compile again, as Dynamo's guards on the code objects a frame ran do.

    Held by identity: the ``__code__`` of the user's functions the trace follows
    (:func:`~spmd_expand.trace.step_functions`), every attribute of the user's classes among the
    model's and the optimizers' classes and their bases (library classes, torch's and installed
    packages', are not watched), each optimizer's instance-level ``step``, and (:meth:`bind`) the
    callables the model's modules hold as instance attributes and how many instance attributes each
    module has (a new one may shadow a method of its class)."""

    def __init__(self, functions: Sequence[Callable], classes: Sequence[type], optimizers: Sequence[Any]) -> None:
        followed = list(_user_functions(list(functions), FOLLOW_DEPTH))
        self.functions = [(fn, fn.__code__) for fn in followed]
        # functools.partial objects those functions load (a global `loss = partial(F.cross_entropy, ...)`):
        # their function and arguments, which can change in place (`loss.keywords["weight"] = ...`).
        partials = {id(v): v for fn in followed for _, _, _, v, _ in _loaded_values(fn) if isinstance(v, functools.partial)}
        self.partials = [(p, _partial_state(p)) for p in partials.values()]
        mro = dict.fromkeys(c for cls in classes for c in cls.__mro__ if _is_user_class(c))
        self.classes = [(cls, dict(vars(cls))) for cls in mro]
        self.optimizers = [(o, vars(o).get("step")) for o in optimizers]
        self.modules: list[tuple[str, nn.Module]] = []
        self.sizes: list[int] = []
        self.keys: list[frozenset] = []
        self.held: list[tuple[str, nn.Module, str, Any]] = []

    def bind(self, model: nn.Module) -> None:
        """Record the model's modules as they are once the trace-time swaps are undone."""
        self.modules = list(model.named_modules())
        self.keys = [frozenset(vars(m)) for _, m in self.modules]
        self.sizes = list(map(len, self.keys))  # compared on every call: cheaper than the names
        self.held = [
            (fqn, m, name, value)
            for fqn, m in self.modules
            for name, value in vars(m).items()
            if callable(value) and not isinstance(value, (nn.Module, torch.Tensor))
        ]

    def check(self) -> Optional[str]:
        """None when the code is what was traced, else what changed."""
        for fn, code in self.functions:
            if fn.__code__ is not code:
                return f"the code of function {fn.__qualname__} was replaced (its __code__)"
        for partial, state in self.partials:
            if not _same_contents(_partial_state(partial), state):
                return f"the functools.partial of {getattr(partial.func, '__name__', partial.func)} has other arguments"
        for cls, attributes in self.classes:
            now = vars(cls)
            if len(now) != len(attributes) or any(now.get(k, _MISSING) is not v for k, v in attributes.items()):
                changed = sorted(k for k in {*now, *attributes} if now.get(k, _MISSING) is not attributes.get(k, _MISSING))
                return f"class {cls.__qualname__} has other attributes ({', '.join(changed)} set, replaced or deleted)"
        for optimizer, step in self.optimizers:
            if vars(optimizer).get("step") is not step:
                return f"the {type(optimizer).__qualname__} optimizer's step was replaced on the instance"
        if list(map(len, map(vars, (m for _, m in self.modules)))) != self.sizes:
            for (fqn, m), keys in zip(self.modules, self.keys):
                now = frozenset(vars(m))
                if now != keys:
                    where = f"model.{fqn}" if fqn else "model"
                    return (f"{where} has other instance attributes (set: {', '.join(sorted(now - keys)) or 'none'}; "
                            f"deleted: {', '.join(sorted(keys - now)) or 'none'}), which may shadow its class's methods")
        for fqn, m, name, value in self.held:
            if vars(m).get(name, _MISSING) is not value:
                return f"model{'.' + fqn if fqn else ''}.{name} holds another callable than when traced"
        return None


class HeldModules:
    """The modules a traced step reaches through a global or closure variable (or an element of a list,
    tuple or dict one holds) that are not the model's: an auxiliary head, a frozen teacher, a criterion
    holding torch loss modules (:func:`settings_variables`). Their parameters and buffers are graph
    inputs, read by name on every call (:class:`TensorConstant`); the rest of them is baked in, so it is
    checked on every call as :class:`~spmd_expand.guards.Snapshot` checks the model's: which object the
    variable holds, which submodule objects it has and their classes, ``train()``/``eval()``, the
    names in their parameter/buffer/module slots and their hooks (by identity). The scalar attributes
    the step reads of them (``LeakyReLU.negative_slope``, ``CrossEntropyLoss.label_smoothing``) are
    recorded as the model's are (:func:`record_reads`)."""

    def __init__(self, held: Sequence[tuple[str, Any, Callable[[], Any]]], model: nn.Module) -> None:
        own = set(map(id, model.modules()))
        self.entries = [
            (description, reader, value, _module_tree_state(value))
            for description, value, reader in held
            if isinstance(value, nn.Module) and id(value) not in own
        ]

    def check(self) -> Optional[str]:
        """None when every held module is as traced, else what changed."""
        for description, reader, module, state in self.entries:
            now = reader()
            if now is not module:
                shown = f"a {type(now).__name__}" if isinstance(now, nn.Module) else _brief(now)
                return f"{description} holds another object than the module the step was traced with (now {shown})"
            changed = _module_tree_change(state, _module_tree_state(module))
            if changed is not None:
                return f"the module in {description} changed since the trace: {changed}"
        return None


def _module_tree_state(module: nn.Module) -> list[tuple]:
    """Per submodule of ``module`` (``named_modules`` order): name, object, class, ``training``, slot
    names, hook dicts' contents. (Their scalar attributes the step reads are recorded one by one:
    :func:`record_reads`.)"""
    return [
        (
            fqn, m, type(m), m.training,
            tuple(tuple(slot) for slot in (m._parameters, m._buffers, m._modules)),
            tuple(tuple(d.values()) for d in MODULE_HOOKS(m)),
        )
        for fqn, m in module.named_modules(remove_duplicate=False)
    ]


def _module_tree_change(before: list[tuple], now: list[tuple]) -> Optional[str]:
    """What differs between two :func:`_module_tree_state` of one module, in words; None if nothing."""
    for old, new in itertools.zip_longest(before, now):
        if old is None or new is None or old[0] != new[0] or old[1] is not new[1]:
            where = (old or new)[0]
            return f"its submodules are others (at {where!r}: a module added, removed or replaced)"
        fqn, _, cls, training, slots, hook_lists = new
        where = f"submodule {fqn!r} ({cls.__name__})" if fqn else f"the module ({cls.__name__})"
        if cls is not old[2]:
            return f"{where} has another class"
        if training != old[3]:
            return f"{where} was switched to {'train()' if training else 'eval()'}"
        if slots != old[4]:
            return f"{where} has other parameters, buffers or submodules by name"
        if len(hook_lists) != len(old[5]) or any(
            len(a) != len(b) or any(map(operator.is_not, a, b)) for a, b in zip(hook_lists, old[5])
        ):
            return f"{where} has hooks added or removed"
    return None


def _partial_state(p: functools.partial) -> tuple:
    """A partial's function and arguments, compared with :func:`_same_contents` (the function and any
    tensor argument by identity, numbers by value)."""
    return p.func, tuple(p.args), dict(p.keywords)


@dataclass
class PythonGuards:
    """What one trace read from outside its inputs, checked on every call: Python values
    (:class:`PythonValue`), torch's global state (:class:`GlobalState`), the code it ran
    (:class:`CodeIdentity`) and the modules it reached outside the model (:class:`HeldModules`)."""

    values: list[PythonValue] = field(default_factory=list)
    global_state: Optional[GlobalState] = None
    # Module attribute reads not yet bound to the model's modules (see bind).
    module_reads: list["ModuleRead"] = field(default_factory=list)
    code: Optional[CodeIdentity] = None
    held_modules: Optional[HeldModules] = None

    def bind(self, model: nn.Module) -> None:
        """Turn :attr:`module_reads` into values read from ``model``'s own modules. Call it once the
        stages that swap modules only while tracing (overrides, SyncBatchNorm stand-ins) have put the
        originals back: a read of a stand-in (or of a module inside one, which has no place in the
        model) then guards every scalar attribute of the model's module at the nearest place (the
        stand-in was built from them; which of them it read is not known)."""
        if self.code is not None:
            self.code.bind(model)
        reads, self.module_reads = self.module_reads, []
        whole: set = set()
        for read in reads:
            place, module = _nearest_submodule(model, read.fqn)
            if read.via is not None:
                # A settings object a module holds (self.config): guarded where the model holds it now,
                # or, held by a stand-in with no place in the model, on the object itself.
                if place == read.fqn and _attribute_reader(lambda: module, read.via)() is read.held:
                    self.values.append(_attribute_value(module, place, f"{read.via}.{read.name}", read.value))
                else:
                    self.values.append(PythonValue(
                        f"attribute {read.name} of the {type(read.held).__name__} in {read.fqn}.{read.via} (a trace-time stand-in)",
                        _attribute_reader(lambda held=read.held: held, read.name),
                        read.value,
                    ))
                continue
            if module is read.module:
                self.values.append(_attribute_value(module, place, read.name, read.value))
            elif id(module) not in whole:
                whole.add(id(module))
                self.values += [
                    _attribute_value(module, place, name, _frozen(value))
                    for name, value in vars(module).items()
                    if name not in _MODULE_OWN and is_scalar(value)
                ]

    def check(self) -> Optional[str]:
        """None when everything is as traced, else what changed, as a sentence for a warning."""
        if self.module_reads:
            raise RuntimeError("PythonGuards.check() before bind(model): module reads are not bound")
        if self.global_state is not None:
            changed = self.global_state.reason()
            if changed is not None:
                return (
                    f"torch's global state differs from the one the step was traced under ({changed}: "
                    f"torch.autocast, the default dtype, deterministic algorithms, matmul precision, the "
                    f"number of threads, or the torch function modes, dispatch modes and saved-tensor hooks "
                    f"around the call); one graph is kept per state"
                )
        # Before the values: a replaced module is named as one, not by the attributes it lacks.
        if self.held_modules is not None:
            changed = self.held_modules.check()
            if changed is not None:
                return f"{changed}; one graph is kept per state of the modules a step reaches outside the model"
        for v in self.values:
            now = v.read()
            if not _same(now, v.value):
                shown = "<deleted>" if now is _MISSING else _brief(now)
                if isinstance(now, dict) and isinstance(v.value, dict) and shown.startswith("a ") and all(
                    isinstance(k, (str, int)) for k in itertools.chain(now, v.value)
                ):  # a settings dict (optimizer.defaults): which entries
                    keys = [k for k in {**v.value, **now} if not _same(now.get(k, _MISSING), v.value.get(k, _MISSING))]
                    shown += f"; entries {', '.join(map(repr, keys[:8]))} differ" if keys else ""
                if ATTRIBUTE_NAMES in v.description and isinstance(v.value, frozenset):
                    owner = v.description.replace(f".{ATTRIBUTE_NAMES}", "").replace(f"{ATTRIBUTE_NAMES} of ", "")
                    added = sorted(now - v.value) if isinstance(now, frozenset) else []
                    removed = sorted(v.value - now) if isinstance(now, frozenset) else sorted(v.value)
                    return (
                        f"the {owner.removeprefix('attribute ')} has attributes set or deleted since the trace "
                        f"(set: {', '.join(added) or 'none'}; deleted: {', '.join(removed) or 'none'}). Its reads "
                        f"cannot be recorded one by one (a SimpleNamespace), so all its attributes are guarded"
                    )
                if v.description.startswith("attribute state of the ") and v.description.endswith(" optimizer") and isinstance(now, dict):
                    return (
                        f"the {v.description.removeprefix('attribute state of the ')}'s state is not the one the step "
                        f"was traced with ({_brief(v.value)}, now {shown}): an optimizer creates state on a step "
                        f"(SGD its momentum_buffer once momentum is set); the graph for the new state compiles once"
                    )
                if isinstance(v.value, _FUNCTION_TYPES):
                    return f"the trace ran the function {v.description} == {_brief(v.value)} (now {shown}); one graph is kept per function"
                as_argument = (
                    "pass it to the step as a float argument (`step(model, optimizer, x, y, beta)`: a graph input, "
                    "one graph for every value), keep it in a "
                    if isinstance(v.value, float) and isinstance(now, float) else "keep it in a "
                )
                return (
                    f"the trace read the Python value {v.description} == {_brief(v.value)} (now {shown}), which the "
                    f"graph bakes in. A value that changes every step recompiles every step: {as_argument}"
                    f"tensor the step is handed (a buffer: model.register_buffer(name, torch.tensor(value)), "
                    f"updated in place with .fill_()), or an optimizer hyperparameter"
                )
        # After the values: a scalar attribute set on a module is named there, with its value.
        if self.code is not None:
            changed = self.code.check()
            if changed is not None:
                return f"the code the step runs is not the code it was traced with: {changed}; one graph is kept per code"
        return None


def _brief(value: Any, limit: int = 80) -> str:
    """``value`` for a message: a container by its type and size (an optimizer's ``state`` holds every
    tensor), anything else by its repr, cut to ``limit`` characters."""
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        if len(items) > 16 or not all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
            return f"a {type(value).__name__} of {len(value)} entries"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------- module reads

# Attributes of nn.Module itself (its bookkeeping: hooks, ``training``, ``_compiled_call_impl``, ...).
_MODULE_OWN = frozenset(nn.Module().__dict__) | frozenset(dir(nn.Module))
_recorders: list[dict] = []
_recording_classes: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _recording_class(cls: type) -> Optional[type]:
    """A subclass of ``cls`` (same name) that notes scalar attribute reads; None if ``cls`` refuses one."""
    sub = _recording_classes.get(cls)
    if sub is None:
        get = cls.__getattribute__

        def __getattribute__(self, name: str, _get=get) -> Any:
            value = _get(self, name)
            if _recorders and name not in _MODULE_OWN and is_guarded(value):
                # A function: only one the object holds (a class's static method is the class's).
                if is_scalar(value) or name in getattr(self, "__dict__", ()):
                    _recorders[-1].setdefault((id(self), name), (self, name, _frozen(value)))
            return value

        fallback = getattr(cls, "__getattr__", None)  # nn.Module's: parameters, buffers, submodules

        def __getattr__(self, name: str, _fallback=fallback) -> Any:
            # Python calls this when __getattribute__ found nothing: an attribute that does not exist
            # unless the class's own __getattr__ finds it. A read of one (getattr(self, "scale", 1.0),
            # hasattr(self, "boost")) is recorded as missing, so setting it later compiles again.
            try:
                if _fallback is None:
                    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
                return _fallback(self, name)
            except AttributeError:
                if _recorders and not name.startswith("__") and name not in _MODULE_OWN:
                    _recorders[-1].setdefault((id(self), name), (self, name, _MISSING))
                raise

        try:
            # __slots__ = (): the same layout, so objects of a class with slots can take it too.
            sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__getattr__": __getattr__,
                                              "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                              "_spmd_recording_of": cls, "__slots__": ()})
        except Exception:  # noqa: BLE001 - a class that cannot be subclassed keeps its reads unrecorded
            return None
        _recording_classes[cls] = sub
    return sub


@dataclass(frozen=True)
class ModuleRead:
    """A scalar attribute read while tracing: the module read (maybe a trace-time stand-in), its
    place in the model, the attribute and the value first read. With ``via``, the read was of the
    plain object ``held`` in the module's attribute ``via`` (``self.config.use_cache``)."""

    module: nn.Module
    fqn: str
    name: str
    value: Any
    via: Optional[str] = None
    held: Any = None


@dataclass
class RecordedReads:
    """What :func:`record_reads` noted: module reads to bind to the model later, and reads of the
    plain objects that globals and closure variables hold, as checks already."""

    module_reads: list[ModuleRead] = field(default_factory=list)
    values: list[PythonValue] = field(default_factory=list)


# Classes whose objects are machinery, not settings: never given a recording class.
_NOT_SETTINGS = (
    nn.Module, torch.Tensor, torch.optim.Optimizer, type, types.ModuleType, types.FunctionType, types.MethodType,
    types.BuiltinFunctionType, functools.partial, weakref.ref,
)
# torch's objects a step reads numbers from: a learning-rate schedule (`scheduler.last_epoch`,
# `scheduler.get_last_lr()[0]` as a scale).
_TORCH_SETTINGS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_MACHINERY_PACKAGES = frozenset({"torch", "spmd_expand", "logging", "threading", "multiprocessing", "numpy"})


def is_settings_object(value: Any) -> bool:
    """An object a step or a forward reads settings from: a HuggingFace config, an
    ``argparse.Namespace``, a dataclass or ``SimpleNamespace`` of hyperparameters, a learning-rate
    scheduler. Not a module, tensor, optimizer, function, class or Python module, and not another
    object of torch, spmd_expand, ``logging``, threads or numpy."""
    if isinstance(value, _NOT_SETTINGS) or is_scalar(value):
        return False
    if isinstance(value, _TORCH_SETTINGS):
        return True
    cls = type(value)
    if (cls.__module__ or "").split(".")[0] in _MACHINERY_PACKAGES:
        return False
    return hasattr(value, "__dict__") or bool(getattr(cls, "__slots__", ()))


def _scalar_attributes(obj: Any) -> dict[str, Any]:
    """Every scalar attribute an object holds (its ``__dict__`` and slots), copied, and the functions
    it holds (:func:`is_guarded`)."""
    found = {k: v for k, v in getattr(obj, "__dict__", {}).items() if is_guarded(v)}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            value = getattr(obj, name, _MISSING)
            if value is not _MISSING and is_guarded(value):
                found[name] = value
    return {k: _frozen(v) for k, v in found.items()}


def argument_key(value: Any, depth: int = 2) -> str:
    """What a non-tensor argument of the step contributes to the cache key: its ``repr``, and for a
    settings object (:func:`is_settings_object`) the scalar attributes it holds and those of the
    settings objects among them, ``depth`` levels down. A plain object's ``repr`` names its address,
    not its values: ``step(model, opt, x, y, cfg)`` with ``cfg.alpha`` changed between calls ran the
    graph traced with the old value. Compared across ranks too (the address removed)."""
    attributes = _nested_attributes(value, depth)
    return repr(value) if attributes is None else f"{value!r} {attributes!r}"


def _nested_attributes(value: Any, depth: int) -> Optional[tuple]:
    if depth < 0 or not is_settings_object(value):
        return None
    found: dict[str, Any] = dict(_scalar_attributes(value))
    for name, held in getattr(value, "__dict__", {}).items():
        nested = _nested_attributes(held, depth - 1)
        if nested is not None:
            found[name] = nested
    return tuple(sorted(found.items()))


def _give_recording_class(obj: Any, swapped: list) -> bool:
    cls = type(obj)
    sub = _recording_class(cls)
    if sub is None:
        return False
    try:
        object.__setattr__(obj, "__class__", sub)  # object's: a frozen dataclass refuses its own setattr
    except (TypeError, AttributeError):  # a layout or a C type refuses __class__ assignment
        return False
    swapped.append((obj, cls))
    return True


@contextlib.contextmanager
def record_reads(model: nn.Module, held: Sequence[tuple[str, Any, Callable[[], Any]]] = ()) -> Iterator[RecordedReads]:
    """While inside, note every scalar attribute read of ``model``'s modules, of the settings objects
    (:func:`is_settings_object`) their attributes hold (``self.config``), of the settings objects
    in ``held``: ``(description, object, reader)`` for each global or closure variable that holds one
    (``reader()`` returns what the variable holds at the time), and of the settings objects all these
    hold, :data:`_NESTED_DEPTH` levels down (``self.args.scale`` of a trainer, ``cfg.optim.lr``).
    Yields a :class:`RecordedReads` filled on exit: one read per (object, attribute), with the value
    first read. An object whose class refuses a recording subclass (``SimpleNamespace``) has every
    scalar attribute it holds recorded.
    """
    names: dict[int, str] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), fqn)
    holders: dict[int, tuple] = {}  # id(settings object) -> (module, fqn, attribute) | (description, reader)
    for fqn, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in _MODULE_OWN and is_settings_object(value):
                holders.setdefault(id(value), (value, ("module", module, fqn, attr)))
    for description, value, reader in held:
        # user_optimizers; a module of a global (a loss module): not one of the model's, recorded above
        if is_settings_object(value) or isinstance(value, torch.optim.Optimizer) or (isinstance(value, nn.Module) and id(value) not in names):
            holders.setdefault(id(value), (value, ("global", description, reader)))
        if isinstance(value, nn.Module) and id(value) not in names:
            # And its submodules (a criterion's torch loss module, a teacher's activations), read by
            # their path from what the variable holds now.
            for fqn, sub in value.named_modules():
                if fqn and id(sub) not in names:
                    holders.setdefault(id(sub), (sub, ("global", f"submodule {fqn} of {description}", _attribute_reader(reader, fqn))))
    frontier = list(holders.values())
    for _ in range(_NESTED_DEPTH):
        frontier = [_nested_holder(child, attr, where, holders) for value, where in frontier
                    for attr, child in list(getattr(value, "__dict__", {}).items())
                    if id(child) not in holders and id(child) not in names and is_settings_object(child)]
    swapped: list = []
    reads: dict = {}
    result = RecordedReads()
    whole: list = []  # settings objects that refused a recording class
    try:
        for module in model.modules():
            _give_recording_class(module, swapped)
        for value, where in holders.values():
            if not _give_recording_class(value, swapped):
                # No read of it is seen, a read of an attribute it lacks either (getattr(ns, "scale",
                # 1.0)): its attributes' values and names are guarded, so one set later is a change.
                attributes = _scalar_attributes(value)
                if hasattr(value, "__dict__"):
                    attributes[ATTRIBUTE_NAMES] = frozenset(vars(value))
                whole.append((value, where, attributes))
        _recorders.append(reads)
        with _recording_environment() as environment:
            yield result
    finally:
        if _recorders and _recorders[-1] is reads:
            _recorders.pop()
        for obj, cls in swapped:
            object.__setattr__(obj, "__class__", cls)
    result.values += [
        PythonValue(f"environment variable {key}", functools.partial(os.environ.get, key, _MISSING), value)
        for key, value in environment.items()
    ]
    found = [(obj, name, value) for obj, name, value in reads.values()]
    found += [(obj, name, value) for obj, _, attributes in whole for name, value in attributes.items()]
    for obj, name, value in found:
        if id(obj) in names:
            result.module_reads.append(ModuleRead(obj, names[id(obj)], name, value))
        elif id(obj) in holders:
            where = holders[id(obj)][1]
            if where[0] == "module":
                _, module, fqn, attr = where
                result.module_reads.append(ModuleRead(module, fqn, name, value, via=attr, held=obj))
            else:
                if name.startswith("_") and isinstance(obj, torch.optim.Optimizer) and not _is_user_class(type(obj)):
                    continue  # torch's own bookkeeping (_need_device_dtype_check_for_fused), not a setting
                _, description, reader = where
                result.values.append(PythonValue(f"attribute {name} of {description}", _attribute_reader(reader, name), value))


@contextlib.contextmanager
def _recording_environment() -> Iterator[dict[str, Any]]:
    """While inside, note the environment variables the user's code reads (``os.environ[k]``,
    ``os.environ.get(k)``, ``os.getenv(k)``, ``k in os.environ``; torch's and other libraries' reads
    are left out) in the yielded ``{key: value}`` (``_MISSING`` for one not set): a step branching on
    one (`if os.environ.get("DEBUG_LOSS"):`) bakes it in, so :func:`record_reads` guards them."""
    found: dict[str, Any] = {}
    environ = os.environ
    base = type(environ)

    class Recording(base):  # type: ignore[valid-type, misc]
        def __getitem__(self, key: Any) -> Any:
            try:
                value = base.__getitem__(self, key)
            except KeyError:
                _note(key, _MISSING)
                raise
            _note(key, value)
            return value

    def _note(key: Any, value: Any) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename in _MAPPING_FILES:
            frame = frame.f_back  # Mapping.get / __contains__, os.getenv
        if frame is not None and not _is_library_path(frame.f_code.co_filename):
            found.setdefault(key, value)

    Recording.__name__ = Recording.__qualname__ = base.__name__
    object.__setattr__(environ, "__class__", Recording)
    try:
        yield found
    finally:
        object.__setattr__(environ, "__class__", base)


_MAPPING_FILES = frozenset({collections.abc.Mapping.get.__code__.co_filename, os.getenv.__code__.co_filename})


# How deep record_reads follows settings objects inside settings objects (trainer.args.optim).
_NESTED_DEPTH = 2


def _nested_holder(child: Any, attr: str, where: tuple, holders: dict) -> tuple:
    """Register ``child``, held in attribute ``attr`` of an object ``holders`` places at ``where``,
    for :func:`record_reads`: under a module, by its dotted path from the module (``config.text``);
    else with a reader through the holder's."""
    if where[0] == "module":
        _, module, fqn, via = where
        placed = ("module", module, fqn, f"{via}.{attr}")
    else:
        _, description, reader = where
        placed = ("global", f"{attr} of {description}", _attribute_reader(reader, attr))
    holders[id(child)] = (child, placed)
    return child, placed


# A pseudo attribute: the names an object's ``__dict__`` holds (a frozenset), for objects whose reads
# cannot be recorded (a ``SimpleNamespace``).
ATTRIBUTE_NAMES = "<attribute names>"


def _attribute_reader(holder: Callable[[], Any], name: str) -> Callable[[], Any]:
    """A reader of attribute ``name`` (dotted names too; the last one may be :data:`ATTRIBUTE_NAMES`)
    of what ``holder()`` returns; ``_MISSING`` when the holder or the attribute is gone."""
    path, _, last = name.rpartition(".")
    if last == ATTRIBUTE_NAMES:
        owner = _attribute_reader(holder, path) if path else holder

        def read_names() -> Any:
            obj = owner()
            return _MISSING if obj is _MISSING else frozenset(getattr(obj, "__dict__", ()))

        return read_names
    get = operator.attrgetter(name)

    def read() -> Any:
        obj = holder()
        if obj is _MISSING:
            return _MISSING
        try:
            return get(obj)
        except AttributeError:
            return _MISSING

    return read


def _nearest_submodule(model: nn.Module, fqn: str) -> tuple[str, nn.Module]:
    """(place, submodule) of ``model`` at ``fqn``, or at its longest prefix that exists."""
    module, place = model, []
    for atom in fqn.split(".") if fqn else ():
        child = module._modules.get(atom)
        if child is None:
            break
        module = child
        place.append(atom)
    return ".".join(place), module


def _attribute_value(module: nn.Module, fqn: str, name: str, value: Any) -> PythonValue:
    """A :class:`PythonValue` reading ``name`` of ``module`` (held weakly; a new module object at
    ``fqn`` is a new snapshot and cache key, so the reader never needs to look it up again)."""
    ref = weakref.ref(module)

    def holder() -> Any:
        m = ref()
        return _MISSING if m is None else m

    return PythonValue(f"attribute {fqn + '.' if fqn else ''}{name} of the model", _attribute_reader(holder, name), value)


# ---------------------------------------------------------------------------------------- code reads


def _is_library(code: types.CodeType) -> bool:
    return _is_library_path(code.co_filename)


@functools.lru_cache(maxsize=4096)  # a few files' paths, read for every module attribute and function
def _is_library_path(path: str) -> bool:
    if path.startswith("<"):
        return True
    if in_torch_or_spmd_expand(path):
        return True
    path = path.replace("\\", "/")
    return "/site-packages/" in path or "/dist-packages/" in path or path.startswith(sys.prefix) or path.startswith(sys.base_prefix)


@functools.lru_cache(maxsize=4096)  # code objects are immutable; reading the bytecode is the cost
def _loads(code: types.CodeType) -> tuple[tuple[str, str], ...]:
    """("global" | "cell", name) for each name ``code`` and its nested code objects load."""
    found = []
    stack = [code]
    while stack:
        c = stack.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                found.append(("global", ins.argval))
            elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
                found.append(("cell", ins.argval))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return tuple(found)


def _loaded_values(fn: types.FunctionType) -> Iterator[tuple[str, str, Any, Any, Callable[[], Any]]]:
    """(kind, name, identity key, value, reader) of each global / closure variable ``fn``'s code loads
    and that exists now, of the attributes of a user module among them that the code names
    (``"module"``, :func:`_module_attributes`), and of ``fn``'s default argument values
    (``"default"``: ``def step(model, opt, x, y, criterion=criterion)`` holds a loss module)."""
    code = fn.__code__
    defaults = fn.__defaults__ or ()
    with_defaults = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
    for i, (name, value) in enumerate(zip(with_defaults, defaults)):
        yield "default", name, (id(fn), name), value, _DefaultSlot(fn, i)
    for name, value in (fn.__kwdefaults__ or {}).items():
        yield "default", name, (id(fn), name), value, _GlobalSlot(fn.__kwdefaults__, name)
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    for kind, name in _loads(code):
        if kind == "global":
            scope = fn.__globals__
            if name in scope:
                yield kind, name, (id(scope), name), scope[name], _GlobalSlot(scope, name)
                if _is_user_module(scope[name]):
                    yield from _module_attributes(scope[name], code)
        else:
            cell = cells.get(name)
            if cell is None:
                continue
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell (assigned later in the enclosing function)
                continue
            yield kind, name, (id(cell), name), value, _CellSlot(cell)


def _is_user_module(value: Any) -> bool:
    """A Python module of the user's (``import config``, ``from project import layers``)."""
    path = getattr(value, "__file__", None) if isinstance(value, types.ModuleType) else None
    return path is not None and not _is_library_path(path)


def _module_attributes(module: types.ModuleType, code: types.CodeType) -> Iterator[tuple[str, str, Any, Any, Callable[[], Any]]]:
    """What :func:`_loaded_values` yields for the attributes of a user module that ``code`` may read
    (``config.SCALE``, ``layers.attention``): each attribute of ``module`` whose name ``code`` uses."""
    scope = vars(module)
    for name in dict.fromkeys(_attribute_names(code)):
        if name in scope and not name.startswith("__"):
            yield "module", f"{module.__name__}.{name}", (id(scope), name), scope[name], _GlobalSlot(scope, name)


# How many calls deep the user's functions are followed. Each function is read once, so the cost is
# the user code reachable, not the depth; 4 missed a value a forward read through five helpers.
FOLLOW_DEPTH = 64


def _user_functions(functions: list[Callable], depth: int) -> Iterator[types.FunctionType]:
    """``functions`` and the Python functions they reach through globals and closure variables, up to
    ``depth`` calls deep, each once; library code (torch, site-packages, the standard library) is not
    followed."""
    seen: set = set()
    todo = [(f, 0) for f in functions]
    while todo:
        fn, level = todo.pop()
        fn = getattr(fn, "__func__", fn)  # bound methods
        code = getattr(fn, "__code__", None)
        # A library decorator's wrapper (``@torch.no_grad()``, ``functools.wraps``): the user's function.
        while code is not None and _is_library(code) and getattr(fn, "__wrapped__", None) is not None:
            fn = getattr(fn.__wrapped__, "__func__", fn.__wrapped__)
            code = getattr(fn, "__code__", None)
        if not isinstance(fn, types.FunctionType) or code is None or code in seen or _is_library(code):
            continue
        seen.add(code)
        yield fn
        if level < depth:
            todo += [(f, level + 1) for _, _, _, value, _ in _loaded_values(fn) for f in _callable_code(value)]


def _callable_code(value: Any) -> list[Callable]:
    """The Python functions using ``value`` can run, where they can be the user's: ``value`` itself (a
    function or bound method), a ``functools.partial``'s function, a user object's methods, bound
    (``LOSS = FocalLoss(gamma=2)`` runs its ``__call__``, ``trainer.loss(out, y)`` its ``loss``; their
    attribute reads are the object's), a user class's methods (``GradReverse.apply(x)`` runs its
    ``forward`` and ``backward``); else none."""
    while isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return [value]
    if isinstance(value, type):
        return [fn for _, fn in _class_functions([value])] if _is_user_class(value) else []
    if isinstance(value, types.ModuleType) or not _is_user_class(type(value)):
        return []
    # A user object: its methods, bound (``trainer.loss(out, y)``; ``__call__`` among them).
    return [types.MethodType(fn, value) for _, fn in _class_functions([type(value)])]


def _class_functions(classes: Sequence[type]) -> list[tuple[str, types.FunctionType]]:
    """(name, function) of what the user's classes among ``classes`` and their bases define: methods,
    and the functions of static and class methods and of properties."""
    found = []
    for cls in dict.fromkeys(c for k in classes for c in k.__mro__ if _is_user_class(c)):
        for name, attr in vars(cls).items():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            elif isinstance(attr, property):
                attr = attr.fget
            if isinstance(attr, types.FunctionType):
                found.append((name, attr))
    return found


def code_reads(functions: list[Callable], depth: int = FOLLOW_DEPTH) -> list[PythonValue]:
    """The scalar globals, closure variables and default arguments the user's ``functions`` read (see
    the module doc), and the functions they hold (:func:`is_guarded`)."""
    result: list[PythonValue] = []
    seen: set = set()
    for fn in _user_functions(functions, depth):
        for kind, name, key, value, read in _loaded_values(fn):
            if key in seen or not is_guarded(value):
                continue
            seen.add(key)
            label = _variable_label(kind, name, fn)
            result.append(PythonValue(label, read, _frozen(value)))
    return result


def class_attribute_reads(functions: list[Callable], classes: Sequence[type], depth: int = FOLLOW_DEPTH) -> list[PythonValue]:
    """Guards for the scalar class attributes the user's code may read through the class
    (``Block.SCALE``, ``type(self).SCALE``, ``self.__class__.SCALE``), which no instance read records:
    of the user's classes among ``classes`` (the model's modules', the optimizer's) and those the
    ``functions`` (followed as :func:`code_reads` follows them) reach through globals, closure
    variables and default arguments, each attribute whose name the followed code uses and that a user
    class in the class's MRO defines as a Python scalar. Read with ``getattr`` on the class, so a
    subclass that sets it later is seen too."""
    fns = list(_user_functions(functions, depth))
    names = set(itertools.chain.from_iterable(_attribute_names(fn.__code__) for fn in fns))
    found = [c for c in classes if _is_user_class(c)]
    found += [v for fn in fns for _, _, _, v, _ in _loaded_values(fn) if isinstance(v, type) and _is_user_class(v)]
    result = []
    for cls in dict.fromkeys(found):
        for name in sorted(names):
            owner = next((base for base in cls.__mro__ if name in vars(base)), None)
            if owner is None or not _is_user_class(owner) or not is_scalar(vars(owner)[name]):
                continue
            result.append(PythonValue(
                f"class attribute {cls.__qualname__}.{name}", _attribute_reader(lambda cls=cls: cls, name), _frozen(vars(owner)[name])
            ))
    return result


def _stores(fn: types.FunctionType) -> tuple[tuple[str, str, str], ...]:
    """("global" | "cell", name, "file:line") for each global or closure variable ``fn``'s code (and
    its nested code) assigns or deletes (``STORE_GLOBAL`` / ``STORE_DEREF`` of a free variable)."""
    return _code_stores(fn.__code__)


@functools.lru_cache(maxsize=4096)  # code objects are immutable (as _loads)
def _code_stores(code: types.CodeType) -> tuple[tuple[str, str, str], ...]:
    found = []
    stack = [code]
    while stack:
        c = stack.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") or (
                ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in c.co_freevars
            ):
                line = ins.positions.lineno if ins.positions is not None else c.co_firstlineno
                found.append(("global" if "GLOBAL" in ins.opname else "cell", ins.argval, f"{c.co_filename}:{line}"))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return tuple(found)


def settings_variables(functions: list[Callable], depth: int = FOLLOW_DEPTH) -> list[tuple[str, Any, Callable[[], Any]]]:
    """(description, object, reader) of each global or closure variable of the user's ``functions``
    (followed as :func:`code_reads` follows them) that holds a settings object
    (:func:`is_settings_object`: ``cfg.alpha``, ``args.label_smoothing``) or a module
    (``criterion = nn.CrossEntropyLoss(label_smoothing=0.1)``, a ``FocalLoss`` whose ``gamma`` a
    schedule changes; :func:`record_reads` leaves the model's own to the model), or a list, tuple or
    dict of them (``HEADS[i].weight``: each element, labelled ``global HEADS of m[0]``), and of the
    object a bound method among ``functions`` belongs to (``self.cfg`` of a trainer's ``train_step``),
    for :func:`record_reads`."""
    result: list = []
    seen: set = set()
    for fn in functions:
        owner = getattr(fn, "__self__", None)
        if owner is not None and is_settings_object(owner) and id(owner) not in seen:
            seen.add(id(owner))
            result.append((f"the {type(owner).__qualname__} object of {fn.__qualname__}", owner, lambda owner=owner: owner))
    for fn in _user_functions(functions, depth):
        for kind, name, key, value, read in _loaded_values(fn):
            if key in seen:
                continue
            seen.add(key)
            label = _variable_label(kind, name, fn)
            if _holds_attributes(value):
                result.append((label, value, read))
            elif isinstance(value, (list, tuple, dict)):
                for k, element in (value.items() if isinstance(value, dict) else enumerate(value)):
                    if _holds_attributes(element):
                        result.append((f"{label}[{k!r}]", element, _element_reader(read, k)))
    return result


@dataclass(frozen=True)
class TensorConstant:
    """A tensor the step reads that is neither its argument nor the model's or the optimizer's: a
    global or closure variable holding one (``CLASS_WEIGHTS``), a parameter or buffer of a module
    held there that is not the model's (``criterion = nn.CrossEntropyLoss(weight=w)``, a frozen
    feature extractor of a perceptual loss), or a plain attribute of a settings object there or of a
    module of the model (:func:`tensor_constants`). A graph input (replicated), read on every call.

    ``label`` names the place (``"buffer weight of global criterion of train"``); ``read()`` returns
    what it holds now (``_MISSING`` when gone); ``write(value)`` puts a value there (a fake tensor
    while tracing, then the original back)."""

    label: str
    read: Callable[[], Any]
    write: Callable[[Any], None]


def liftable(value: Any) -> bool:
    """A tensor a graph can take as a replicated input in place of the step reading it: a plain
    tensor (not a DTensor or another subclass: a ``Parameter`` is one only if it needs no gradient)
    that needs no gradient, dense and contiguous (the step is traced for a contiguous input of its
    shape, as for a batch tensor)."""
    return (
        isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, nn.Parameter) and not value.requires_grad
        and value.layout == torch.strided and value.is_contiguous()
    )


def tensor_constants(
    functions: list[Callable], model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, depth: int = FOLLOW_DEPTH
) -> list[TensorConstant]:
    """The :class:`TensorConstant` places the user's ``functions`` (followed as :func:`code_reads`
    follows them) read: each global, closure variable or default argument value holding a tensor
    that needs no gradient (:func:`liftable`) or a list or dict of them (each element), each such
    parameter and buffer of a module held there that is not one of ``model``'s (by dotted name from
    it), and each such tensor held as a
    plain attribute of a settings object there (:func:`settings_variables`, the object a method step
    belongs to included) or of one of ``model``'s modules (not a parameter or buffer), where the
    followed code names the attribute (as :func:`class_attribute_reads` finds class attributes: an
    attribute no code reads is not an input, and its values are not compared across ranks). Tensors
    of ``model`` and ``optimizer``'s state are inputs already and are left out, as are tensors that
    need a gradient (the step would train them: a graph has no place to put it)."""
    found: list[TensorConstant] = []
    seen: set = set()
    own: set = set()  # ids of the model's modules and tensors and the optimizer's states

    def is_own(value: Any) -> bool:
        if not own:  # gathered at the first candidate (most steps have none)
            own.update(map(id, itertools.chain(model.modules(), model.parameters(), model.buffers())))
            own.update(id(v) for _, state in (optimizer_state.items(optimizer) if optimizer is not None else ()) for v in state.values())
        return id(value) in own
    followed = list(_user_functions(functions, depth))
    names = set(itertools.chain.from_iterable(_attribute_names(fn.__code__) for fn in followed))
    for fn in followed:
        for kind, name, key, value, slot in _loaded_values(fn):
            if key in seen or not isinstance(value, (torch.Tensor, nn.Module, list, dict)):
                continue
            seen.add(key)
            if is_own(value):
                continue
            label = _variable_label(kind, name, fn)
            if liftable(value):
                found.append(TensorConstant(label, slot, slot.write))
            elif type(value) in (list, dict):  # (a tuple cannot take a stand-in and keep its identity)
                for k, element in value.items() if type(value) is dict else enumerate(value):
                    if liftable(element) and not is_own(element):
                        found.append(TensorConstant(f"{label}[{k!r}]", _element_reader(slot, k), _element_writer(slot, k)))
            elif isinstance(value, nn.Module):
                tensors = itertools.chain(
                    (("parameter", n, t) for n, t in value.named_parameters(remove_duplicate=False)),
                    (("buffer", n, t) for n, t in value.named_buffers(remove_duplicate=False)),
                )
                for what, dotted, tensor in tensors:
                    if liftable(tensor) and not is_own(tensor):
                        read, write = _module_tensor_slot(slot, dotted)
                        found.append(TensorConstant(f"{what} {dotted} of {label}", read, write))
    # Tensors held as plain attributes: of the settings objects those variables hold (`args.class_weights`)
    # and of the object a method step belongs to (a trainer's `self.class_weights`), and of the model's
    # own modules (`self.scale = torch.ones(d)` in `__init__`, not registered as a buffer).
    for label, reader, name, value, _ in _plain_attributes(functions, model, names, depth):
        if liftable(value) and not is_own(value):
            found.append(TensorConstant(label, _attribute_reader(reader, name), _attribute_writer(reader, name)))
    # Labels name graph inputs: one place each (a second place of the same name stays unlifted, and a
    # trace reading from it fails with the TraceError rather than taking the first place's tensor).
    unique: dict[str, TensorConstant] = {}
    for constant in found:
        unique.setdefault(constant.label, constant)
    return list(unique.values())


def float_places(
    functions: list[Callable], model: Optional[nn.Module] = None, depth: int = FOLLOW_DEPTH
) -> list[tuple[str, Callable[[], Any]]]:
    """(label, slot) of each place holding a Python ``float`` (not a bool or an int, not a numpy
    scalar) that the user's ``functions`` (followed as :func:`code_reads` follows them) read and that
    no followed code assigns (``global SCALE; SCALE *= 0.9``, ``self.t = self.t * 0.99`` stay guards:
    such an assignment is replayed after each call):

    * a global, a closure variable, a user module's attribute (``config.SCALE``); default argument
      values are left out (an argument the caller may pass instead is a float argument already);
    * a plain attribute (in its ``__dict__``) of a settings object there or of the object a method step
      belongs to (:func:`settings_variables`, and the settings objects they hold, as
      :func:`record_reads` follows them: ``args.kl_weight``, a trainer's ``self.loss_scale``) or of a
      module of ``model`` whose class is the user's (``self.temperature``; torch's and installed
      packages' modules keep theirs: ``nn.Dropout.p``, ``nn.LayerNorm.eps`` are settings of library
      code, which is not followed), where the followed code names the attribute.

    The slot reads the place (call it; ``_MISSING`` when gone) and writes it (``slot.write``)."""
    followed = list(_user_functions(functions, depth))
    assigned = {(kind, name) for fn in followed for kind, name, _ in _stores(fn)}
    names = set(itertools.chain.from_iterable(_attribute_names(fn.__code__) for fn in followed))
    names -= set(itertools.chain.from_iterable(_stored_attribute_names(fn.__code__) for fn in followed))
    found: dict[str, Callable[[], Any]] = {}
    seen: set = set()
    for fn in followed:
        for kind, name, key, value, slot in _loaded_values(fn):
            if key in seen or type(value) is not float or kind == "default":
                continue
            seen.add(key)
            if (("global" if kind == "global" else "cell"), name) in assigned:
                continue
            found.setdefault(_variable_label(kind, name, fn), slot)
    for label, reader, name, value, module in _plain_attributes(functions, model, names, depth):
        if type(value) is float and (module is None or _is_user_class(type(module))):
            found.setdefault(label, _AttributeSlot(reader, name))
    return list(found.items())


def _plain_attributes(
    functions: list[Callable], model: Optional[nn.Module], names: set, depth: int = FOLLOW_DEPTH
) -> Iterator[tuple[str, Callable[[], Any], str, Any, Optional[nn.Module]]]:
    """(label, reader of the holder, name, value, the module or None) of each plain attribute (in the
    holder's ``__dict__``) whose name is in ``names``: of the settings objects :func:`settings_variables`
    finds for ``functions`` and those they hold, :data:`_NESTED_DEPTH` levels down (as
    :func:`record_reads` follows them), and of ``model``'s modules (not ``nn.Module``'s own)."""
    objects = [(label, obj, reader) for label, obj, reader in settings_variables(functions, depth) if not isinstance(obj, nn.Module)]
    for level in range(_NESTED_DEPTH + 1):
        nested = []
        for label, obj, reader in objects:
            for name, value in list(getattr(obj, "__dict__", {}).items()):
                if name in names:
                    yield f"attribute {name} of {label}", reader, name, value, None
                if level < _NESTED_DEPTH and is_settings_object(value):
                    nested.append((f"{name} of {label}", value, _attribute_reader(reader, name)))
        objects = nested
    for fqn, module in model.named_modules() if model is not None else ():
        place = f"the model's module {fqn}" if fqn else "the model"
        for name, value in list(vars(module).items()):
            if name in names and name not in _MODULE_OWN:
                yield f"attribute {name} of {place}", lambda m=module: m, name, value, module


class _AttributeSlot:
    """A reader (call it) and writer (:meth:`write`) of the plain attribute ``name`` (an entry of its
    ``__dict__``) of what ``holder()`` returns; ``_MISSING`` when either is gone. Writes with
    ``object.__setattr__``: a frozen dataclass's or a module's own ``__setattr__`` is not run."""

    def __init__(self, holder: Callable[[], Any], name: str) -> None:
        self.holder, self.name = holder, name

    def __call__(self) -> Any:
        obj = self.holder()
        return _MISSING if obj is _MISSING else getattr(obj, "__dict__", {}).get(self.name, _MISSING)

    def write(self, value: Any) -> None:
        object.__setattr__(self.holder(), self.name, value)


@functools.lru_cache(maxsize=4096)  # code objects are immutable (as _loads)
def _stored_attribute_names(code: types.CodeType) -> frozenset[str]:
    """The attribute names ``code`` and its nested code objects assign or delete (``STORE_ATTR`` /
    ``DELETE_ATTR``: ``self.t = ...``, ``args.scale *= 0.9``)."""
    found = set()
    stack = [code]
    while stack:
        c = stack.pop()
        found.update(ins.argval for ins in dis.get_instructions(c) if ins.opname in ("STORE_ATTR", "DELETE_ATTR"))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(found)


def _element_writer(holder: Callable[[], Any], key: Any) -> Callable[[Any], None]:
    """A writer of ``holder()[key]`` (a list's or a dict's element)."""

    def write(value: Any) -> None:
        holder()[key] = value

    return write


def _attribute_writer(holder: Callable[[], Any], name: str) -> Callable[[Any], None]:
    """A writer of plain attribute ``name`` of what ``holder()`` returns (``object.__setattr__``: a
    frozen dataclass's or a module's own ``__setattr__`` is not run)."""
    return lambda value: object.__setattr__(holder(), name, value)


def _module_tensor_slot(holder: Callable[[], Any], dotted: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(reader, writer) of the parameter or buffer at ``dotted`` of the module ``holder()`` returns,
    through its ``_parameters`` / ``_buffers`` dict (as ``torch.nn.utils.stateless`` swaps them)."""
    path, _, name = dotted.rpartition(".")

    def owner() -> Any:
        module = holder()
        for atom in path.split(".") if path else ():
            module = getattr(module, "_modules", {}).get(atom, _MISSING)
        return module

    def read() -> Any:
        module = owner()
        if not isinstance(module, nn.Module):
            return _MISSING
        return module._parameters.get(name, module._buffers.get(name, _MISSING))

    def write(value: Any) -> None:
        module = owner()
        (module._parameters if name in module._parameters else module._buffers)[name] = value

    return read, write


def _holds_attributes(value: Any) -> bool:
    """Whether :func:`record_reads` records attribute reads of ``value``."""
    return is_settings_object(value) or isinstance(value, nn.Module)


def _element_reader(holder: Callable[[], Any], key: Any) -> Callable[[], Any]:
    """A reader of ``holder()[key]``; ``_MISSING`` when it is gone."""

    def read() -> Any:
        try:
            return holder()[key]
        except (KeyError, IndexError, TypeError):
            return _MISSING

    return read


def code_writes(functions: list[Callable], depth: int = FOLLOW_DEPTH) -> list[str]:
    """Where the user's ``functions`` (followed as :func:`code_reads` follows them) assign a global or
    a closure variable: ``"global STEP at file:line"``. Such Python side effects run when the step is
    traced, not on every call."""
    return [
        f"{'global' if kind == 'global' else 'closure variable'} {name} at {where}"
        for fn in _user_functions(functions, depth)
        for kind, name, where in _stores(fn)
    ]


def code_prints(functions: list[Callable], depth: int = FOLLOW_DEPTH) -> list[str]:
    """Where the user's ``functions`` (followed as :func:`code_reads` follows them) call the builtin
    ``print``: ``"file:line"``. A print runs when the step is traced, with fake tensors in place of
    values, and not on later calls."""
    found = []
    for fn in _user_functions(functions, depth):
        if "print" in fn.__globals__:  # the module defines its own print
            continue
        stack = [fn.__code__]
        while stack:
            c = stack.pop()
            for ins in dis.get_instructions(c):
                if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "print":
                    line = ins.positions.lineno if ins.positions is not None else c.co_firstlineno
                    found.append(f"{c.co_filename}:{line}")
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return found


def _variable_label(kind: str, name: str, fn: types.FunctionType) -> str:
    """How a warning or an error names a global (``kind == "global"``), a user module's attribute
    (``"module"``, ``name`` qualified), a default argument value of ``fn`` (``"default"``) or a closure
    variable of ``fn``."""
    if kind == "module":
        return f"module attribute {name}"
    if kind == "default":
        return f"default argument {name} of {fn.__qualname__}"
    return f"global {name} of {fn.__module__}" if kind == "global" else f"closure variable {name} of {fn.__qualname__}"


class _GlobalSlot:
    """A reader (call it) and writer (:meth:`write`) of ``scope[name]``: a global, a user module's
    attribute, a keyword-only default; ``_MISSING`` when it is unset."""

    def __init__(self, scope: dict, name: str) -> None:
        self.scope, self.name = scope, name

    def __call__(self) -> Any:
        return self.scope.get(self.name, _MISSING)

    def write(self, value: Any) -> None:
        self.scope[self.name] = value


class _DefaultSlot:
    """A reader and writer of the ``i``-th default argument value of ``fn``."""

    def __init__(self, fn: types.FunctionType, i: int) -> None:
        self.fn, self.i = fn, i

    def __call__(self) -> Any:
        defaults = self.fn.__defaults__ or ()
        return defaults[self.i] if self.i < len(defaults) else _MISSING

    def write(self, value: Any) -> None:
        defaults = list(self.fn.__defaults__)
        defaults[self.i] = value
        self.fn.__defaults__ = tuple(defaults)


class _CellSlot:
    """A reader and writer of a closure variable's cell."""

    def __init__(self, cell: types.CellType) -> None:
        self.cell = cell

    def __call__(self) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:
            return _MISSING

    def write(self, value: Any) -> None:
        self.cell.cell_contents = value


def forward_functions(model: nn.Module) -> list[Callable]:
    """The ``forward`` function of each distinct module class of ``model`` (and of an instance-level
    ``forward``), and the callables its modules hold as plain attributes (``self.act = swish``,
    ``self.loss_fn = FocalLoss(gamma=2)``, a ``functools.partial``), for :func:`code_reads`."""
    found: dict[int, Callable] = {}
    for module in model.modules():
        fn = module.__dict__.get("forward") or getattr(type(module), "forward", None)
        if fn is not None:
            found.setdefault(id(getattr(fn, "__func__", fn)), fn)
        for name, value in vars(module).items():
            if name in _MODULE_OWN or type(value) in _SCALAR_TYPES or isinstance(value, (nn.Module, torch.Tensor)):
                continue  # nn.Module's bookkeeping (hook dicts, `training`, `forward`), numbers, submodules
            for held in _callable_code(value):
                found.setdefault(id(getattr(held, "__func__", held)), held)
    return list(found.values())


def _attribute_names(code: types.CodeType) -> Iterator[str]:
    """The attribute and global names ``code`` and its nested code objects use (``co_names``)."""
    stack = [code]
    while stack:
        c = stack.pop()
        yield from c.co_names
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def called_methods(functions: list[Callable], classes: Sequence[type], depth: int = FOLLOW_DEPTH) -> list[types.FunctionType]:
    """The methods of ``classes`` (the user's classes among them and their bases; library classes are
    not followed) that ``functions``, or the functions they reach, may call by name: ``self.helper(x)``
    in a ``forward``, ``model.compute_loss(batch)`` in a step, ``self.attn.scores(q, k)``, a property.

    Globals and closure variables are followed by value (:func:`_user_functions`); a method is reached
    through an attribute, whose value is only known when the code runs. So this follows names: a
    method of one of ``classes`` whose name the code uses as an attribute or global name counts as
    called (it may not be, which only adds guards). Returns them in the order found, each once."""
    by_name: dict[str, list[types.FunctionType]] = {}
    for name, fn in _class_functions(classes):
        by_name.setdefault(name, []).append(fn)
    found: list[types.FunctionType] = []
    followed: set[str] = set()
    seen: set = set()
    todo = list(functions)
    while todo and by_name:
        reached = [fn for fn in _user_functions(todo, depth) if fn.__code__ not in seen]
        todo = []
        for fn in reached:
            seen.add(fn.__code__)
            for name in _attribute_names(fn.__code__):
                if name in by_name and name not in followed:
                    followed.add(name)
                    todo += by_name[name]
                    found += by_name[name]
    return list(dict.fromkeys(found))


MODULE_HOOKS = operator.attrgetter("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
TENSOR_HOOKS = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")


def hooks(modules: Sequence[nn.Module], params: Sequence[torch.Tensor], optimizer: Optional[torch.optim.Optimizer]) -> tuple[list, list]:
    """The hooks a traced step runs: (the non-empty hook dicts and their callables, by identity; the
    dicts' sizes).

    Places: each module's forward-pre / forward / backward-pre / backward hooks, each parameter's
    gradient hooks (``register_hook``) and post-accumulate-grad hooks, the step pre/post hooks of the
    optimizer and of the optimizers it wraps, and torch's global module and optimizer hooks. A hook
    added or removed between calls is a new graph (the trace ran the hooks that were there); Dynamo
    guards on the same dicts. Each dict
    belongs to one place, so its identity says where a hook is. C-level iteration (``attrgetter``,
    ``chain``, ``filter``): about 0.3 us per parameter.
    """
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    places = [
        module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks,
        module_hooks._global_backward_pre_hooks, module_hooks._global_backward_hooks,
    ]
    if optimizer is not None:
        places += (optimizer_hooks._global_optimizer_pre_hooks, optimizer_hooks._global_optimizer_post_hooks)
        # And the optimizers it wraps (a Lookahead's base). One that wraps another without calling
        # ``Optimizer.__init__`` (timm's Lookahead) has no step hooks of its own.
        for _, holder in optimizer_state.holders(optimizer):
            places += (getattr(holder, "_optimizer_step_pre_hooks", None), getattr(holder, "_optimizer_step_post_hooks", None))
    chain = itertools.chain.from_iterable
    dicts = list(filter(None, itertools.chain(places, chain(map(MODULE_HOOKS, modules)), chain(map(TENSOR_HOOKS, params)))))
    return dicts + [h for d in dicts for h in d.values()], [len(d) for d in dicts]


def user_optimizers(optimizer: Optional[torch.optim.Optimizer]) -> list[tuple[str, torch.optim.Optimizer]]:
    """``(description, optimizer)`` for ``optimizer`` and each optimizer it wraps
    (:func:`spmd_expand.optimizer_state.holders`) whose class is the user's: a Lookahead written in
    the user's code, which counts its steps in an attribute (``self._la_step += 1``) and syncs every
    k-th. Their attribute reads are guarded (:func:`record_reads`) and their changes watched
    (:class:`StateWatch`) like a settings object's; torch's optimizers keep their settings in param
    groups, which are graph inputs or part of the cache key."""
    if optimizer is None:
        return []
    return [
        (f"the {type(holder).__qualname__} optimizer{f' (optimizer.{prefix[:-1]})' if prefix else ''}", holder)
        for prefix, holder in optimizer_state.holders(optimizer)
        if _is_user_class(type(holder))
    ]


def hook_functions(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[list[Callable], list[Any]]:
    """The user's hooks that a traced step of ``model`` and ``optimizer`` can run (:func:`hooks`), for
    :func:`code_reads`, :class:`StateWatch` and :func:`code_prints`, as the model's ``forward``
    functions are: ``(functions, objects)``. The functions as :func:`_callable_code` finds them (a
    partial's function, a user object's bound ``__call__``); a bound method's ``self`` and a callable
    object are among ``objects``.

    A hook runs when the step is traced, not on every call: the globals and closure variables it reads
    must be guarded (``lambda g: g * SCALE`` baked ``SCALE`` in), and what it changes warned about or
    refused (``acts.append(out)`` kept a stand-in tensor), like the step's own Python.
    """
    found, _ = hooks(list(model.modules()), list(model.parameters()), optimizer)
    functions: list[Callable] = []
    objects: list[Any] = []
    for hook in found:
        if isinstance(hook, dict):
            continue
        functions += _callable_code(hook)
        while isinstance(hook, functools.partial):
            hook = hook.func
        if isinstance(hook, types.MethodType):
            objects.append(hook.__self__)
        elif not isinstance(hook, (types.FunctionType, type)):
            objects.append(hook)
    return functions, objects


# ---------------------------------------------------------------------------------------- state the step changes

_CONTAINERS = (list, dict, set, collections.deque)


@dataclass(frozen=True)
class StateChange:
    """A change the step's Python made, while it was traced, to state that outlives the call: a
    global or closure container (``LOSSES.append(loss)``, ``STATS["n"] += 1``), an attribute of a user
    object such a variable holds, or a plain attribute of one of the model's modules
    (``self.cache = t``, ``self.calls += 1``). ``traced`` is true when the new value holds a tensor or a
    symbolic size of the trace, which exist only while tracing; ``undo()`` puts the old contents back.

    ``replay``, where the change is assignments of Python scalars to attributes or variables
    (``self.calls += 1``, ``self.phase = (self.phase + 1) % k``, ``global STEP; STEP += 1``), makes the
    same assignments again. The graph runs only where every value the trace read is what it read (its
    guards), so these values are what the step's Python would assign on that call: storing them after
    each run keeps a counter the step reads in step with one device's (a cycle of values reuses cached
    graphs, whose Python does not run). ``assigned`` holds those values; a symbolic number among them
    (``self.last_lam = lam`` of a float input) is what ``replay(resolve)`` passes through ``resolve``
    to get the call's value."""

    description: str
    detail: str
    traced: bool
    in_module: bool
    # In a module whose class is library code (torch's, an installed package's): its own bookkeeping.
    in_library_module: bool
    undo: Callable[[], None]
    replay: Optional[Callable[..., None]] = None
    assigned: Optional[dict] = None


def _is_traced(value: Any) -> bool:
    """Whether ``value`` (or a list, tuple or dict in it) holds a fake tensor or a symbolic number."""
    from torch._subclasses.fake_tensor import is_fake

    return any(
        isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (isinstance(leaf, torch.Tensor) and is_fake(leaf))
        for leaf in torch.utils._pytree.tree_leaves(value)
    )


def _is_user_object(value: Any) -> bool:
    """A settings object (:func:`is_settings_object`) with a ``__dict__`` whose class is defined in the
    user's code, or an ``argparse.Namespace`` / ``SimpleNamespace`` (the standard library's holders of
    the user's values), whose attributes a step may change (``tracker.count += 1``, ``args.last = x``)."""
    if type(value) in (argparse.Namespace, types.SimpleNamespace):
        return True
    return is_settings_object(value) and hasattr(value, "__dict__") and _is_user_class(type(value))


def _is_user_class(cls: type) -> bool:
    """Whether ``cls`` is defined in the user's code (not torch, an installed package or the standard
    library): in the script or notebook being run (``__main__``, which has no file in a notebook), or
    in a module whose file is not library code."""
    if cls.__module__ == "__main__":
        return True
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return path is not None and not _is_library_path(path)


def _shown(value: Any) -> str:
    if _is_traced(value):
        return "a tensor computed in the step" if isinstance(value, torch.Tensor) else "a value computed in the step"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Variable:
    """A global or closure variable the step assigns, watched like an object with one attribute."""

    def __init__(self, scope: Optional[dict], cell: Optional[types.CellType], name: str) -> None:
        self.scope, self.cell, self.name = scope, cell, name

    def items(self) -> dict:
        if self.scope is not None:
            return {self.name: self.scope[self.name]} if self.name in self.scope else {}
        try:
            return {self.name: self.cell.cell_contents}
        except ValueError:
            return {}

    def restore(self, old: dict) -> None:
        if self.scope is not None:
            if self.name in old:
                self.scope[self.name] = old[self.name]
            else:
                self.scope.pop(self.name, None)
        elif self.name in old:
            self.cell.cell_contents = old[self.name]
        else:
            with contextlib.suppress(ValueError):
                del self.cell.cell_contents


def _snapshot(obj: Any) -> Any:
    if isinstance(obj, _Variable):
        return obj.items()
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, set):
        return set(obj)
    if isinstance(obj, _CONTAINERS):
        return list(obj)
    return {k: v for k, v in vars(obj).items() if not (isinstance(obj, nn.Module) and k in _MODULE_OWN)}


def _unchanged(a: Any, b: Any) -> bool:
    """The same object, or equal Python scalars (never ``==`` on tensors or user objects)."""
    return a is b or (type(a) is type(b) and (type(a) in _SCALAR_TYPES or _numpy_type(a, "generic")) and bool(a == b))


def _difference(old: Any, new: Any, attributes: bool = False) -> Optional[tuple[str, list]]:
    """(what changed, the values that are new) between two snapshots of one object, or None."""
    if isinstance(old, set):
        ids = {id(v) for v in old}
        added = [v for v in new if id(v) not in ids]
        return None if not added and len(new) == len(old) else (f"{len(old)} -> {len(new)} items", added)
    if isinstance(old, list):
        if len(old) == len(new) and all(_unchanged(a, b) for a, b in zip(old, new)):
            return None
        added = [v for v in new if all(v is not o for o in old)]
        what = f"{len(old)} -> {len(new)} items" if len(old) != len(new) else "items replaced"
        return what, added
    keys = [k for k in {**old, **new} if k not in old or k not in new or not _unchanged(old[k], new[k])]
    if not keys:
        return None
    parts = [f"{k if attributes else repr(k)}: {_shown(old.get(k, _MISSING)) if k in old else '<unset>'} -> {_shown(new[k]) if k in new else '<deleted>'}" for k in keys[:3]]
    return ", ".join(parts) + (f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""), [new[k] for k in keys if k in new]


def _scalar_assignments(old: dict, new: dict) -> Optional[dict]:
    """The changed entries of an object's attributes (or a variable) when every one of them is now a
    Python scalar or a symbolic number of the trace (nothing deleted, no container or object
    assigned); None otherwise."""
    changed = {k: new.get(k, _MISSING) for k in {**old, **new} if k not in old or k not in new or not _unchanged(old[k], new[k])}
    scalar = lambda v: is_scalar(v) or isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))  # noqa: E731
    return changed if all(v is not _MISSING and scalar(v) for v in changed.values()) else None


def _assign(obj: Any, values: dict, resolve: Callable[[Any], Any] = lambda v: v) -> None:
    values = {k: resolve(v) for k, v in values.items()}
    if isinstance(obj, _Variable):
        obj.restore({**obj.items(), **values})
    else:
        vars(obj).update(values)


def _restore(obj: Any, old: Any) -> None:
    if isinstance(obj, _Variable):
        obj.restore(old)
    elif isinstance(obj, (dict, set)):
        obj.clear()
        obj.update(old)
    elif isinstance(obj, collections.deque):
        obj.clear()
        obj.extend(old)
    elif isinstance(obj, list):
        obj[:] = old
    else:
        attrs = vars(obj)
        for k in [k for k in attrs if k not in old and not (isinstance(obj, nn.Module) and k in _MODULE_OWN)]:
            del attrs[k]
        attrs.update(old)


def _hidden_state(obj: Any) -> Optional[tuple[str, Any, Optional[Callable[[Any], None]]]]:
    """``(kind, state, restore)`` of an object whose state changes below its Python attributes when
    used: a random number generator that is not the module-level one (``random.Random()``, numpy's
    ``default_rng()`` Generator, ``RandomState``; ``restore(state)`` puts it back), or an iterator (a
    generator, ``itertools.count()``, ``iter(list)``; ``restore`` None: it cannot be rewound); None for
    anything else. Two states compare with :func:`_same_contents`."""
    import random

    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return "random.Random", obj.getstate(), obj.setstate
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(obj, numpy.random.Generator):  # its state is its bit generator's
            bits = obj.bit_generator
            return "numpy.random.Generator", bits.state, lambda state: setattr(bits, "state", state)
        if isinstance(obj, numpy.random.RandomState):
            return "numpy.random.RandomState", obj.get_state(legacy=False), obj.set_state
        if isinstance(obj, numpy.random.BitGenerator):
            return f"numpy.random.{type(obj).__name__}", obj.state, lambda state: setattr(obj, "state", state)
    if isinstance(obj, types.GeneratorType):
        frame = obj.gi_frame
        # Where it is suspended and its locals (`w += 0.5` between two `yield w` at the same place).
        return "generator", None if frame is None else (frame.f_lasti, dict(frame.f_locals)), None
    # An iterator class of the user's has attributes, watched as a user object's are (replayed).
    if isinstance(obj, collections.abc.Iterator) and not hasattr(obj, "__dict__"):
        # C iterators (itertools.count, a list's iterator) show their position through pickling's
        # __reduce__ (`count(3)`, `(iter, (list,), 2)`); where that is missing, their repr.
        kind = type(obj).__qualname__ if type(obj).__module__ == "builtins" else f"{type(obj).__module__}.{type(obj).__qualname__}"
        try:
            with warnings.catch_warnings():  # Python 3.12-3.13 deprecate itertools' pickling
                warnings.simplefilter("ignore", DeprecationWarning)
                return kind, obj.__reduce__(), None
        except Exception:  # noqa: BLE001 - any iterator without __reduce__ (itertools from Python 3.14: its repr)
            return kind, repr(obj), None
    return None


def _same_contents(a: Any, b: Any) -> bool:
    """Equal snapshots of an object's contents (a :func:`_hidden_state`, a partial's arguments):
    containers item by item, numbers, strings and arrays by value, any other object by identity (an
    iterator's list, a generator's local or a partial's argument holding a tensor)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same_contents, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_contents(a[k], b[k]) for k in a)
    if a is None or isinstance(a, (int, float, complex, str, bytes)) or _numpy_type(a, "generic"):
        return bool(a == b)
    if _numpy_type(a, "ndarray"):
        return a.shape == b.shape and bool((a == b).all())
    return a is b


@dataclass(frozen=True)
class HiddenStateUse:
    """An object with state below its Python attributes (:func:`_hidden_state`) that the step used
    while it was traced: ``label`` where it is held (``model.noise.rng``, ``global RNG of step``),
    ``kind`` its type, ``is_random`` whether it is a random generator (:meth:`StateWatch.rewind` puts
    those back) or an iterator (which cannot be rewound)."""

    label: str
    kind: str
    is_random: bool


class StateWatch:
    """Snapshots of the Python state a step can change (see :class:`StateChange`), taken before it is
    traced; :meth:`changes` compares after. Objects whose state lives below their attributes (random
    generators, iterators: :func:`_hidden_state`) that those hold are watched too: :meth:`hidden_uses`. Watched: each list, dict, set or deque and each user object
    that a global or closure variable of ``functions`` holds (followed as :func:`code_reads` follows
    them), the containers and user objects inside those (one level), and the plain attributes of
    ``model``'s modules and the containers they hold. Shallow: each watched object's own items and
    attributes are compared by identity (scalars by value). ``objects``: more user objects to watch
    (the objects of hooks, :func:`hook_functions`), and ``labelled``: ``(label, object)`` of user
    objects watched under that label (a user optimizer class, :func:`user_optimizers`)."""

    def __init__(
        self,
        functions: list[Callable],
        model: Optional[nn.Module],
        depth: int = FOLLOW_DEPTH,
        objects: Sequence[Any] = (),
        labelled: Sequence[tuple[str, Any]] = (),
    ) -> None:
        # (description, in a module, in a library module, object, snapshot)
        self._watched: list[tuple[str, bool, bool, Any, Any]] = []
        # (description, object, kind, state, restore) of the random generators and iterators held there
        self._hidden: list[tuple[str, Any, str, Any, Optional[Callable[[Any], None]]]] = []
        model_modules = {id(m) for m in model.modules()} if model is not None else set()
        seen: set = set(model_modules)  # watched below, as the model's
        assigned: set = set()
        for obj in objects:  # a hook's object (hook_functions): its attributes, as a global's
            if not isinstance(obj, nn.Module):
                self._watch(obj, f"the hook object {type(obj).__qualname__}", False, False, seen, 1)
        for label, obj in labelled:
            self._watch(obj, label, False, False, seen, 1, attributes=True)
        for fn in _user_functions(functions, depth):
            for kind, name, _, value, _ in _loaded_values(fn):
                label = _variable_label(kind, name, fn)
                self._watch(value, label, False, False, seen, 1)
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
            for kind, name, _ in _stores(fn):
                if (kind, name) not in assigned and (kind == "global" or name in cells):
                    assigned.add((kind, name))
                    slot = _Variable(fn.__globals__, None, name) if kind == "global" else _Variable(None, cells[name], name)
                    label = _variable_label(kind, name, fn)
                    self._watched.append((label, False, False, slot, slot.items()))
        if model is not None:
            seen -= model_modules
            for fqn, module in model.named_modules():
                self._watch(module, f"model.{fqn}" if fqn else "model", True, not _is_user_class(type(module)), seen, 1)

    def _watch(
        self, obj: Any, label: str, in_module: bool, library: bool, seen: set, depth: int, attributes: bool = False
    ) -> None:
        # A user module's plain attributes include the user's own objects (``self.criterion =
        # FocalLoss()``): watched as a global's are, with one more level (their lists).
        hidden = None if id(obj) in seen or isinstance(obj, (nn.Module, torch.Tensor)) else _hidden_state(obj)
        if hidden is not None:
            seen.add(id(obj))
            self._hidden.append((label, obj, *hidden))
            return
        held = in_module and not library and depth >= 0 and not isinstance(obj, nn.Module) and _is_user_object(obj)
        # Outside the model: a user object, or a module a global holds (a loss module's attributes).
        attributes = attributes or isinstance(obj, nn.Module) or (held if in_module else _is_user_object(obj))
        if (not attributes and not isinstance(obj, _CONTAINERS)) or id(obj) in seen:
            return
        seen.add(id(obj))
        snap = _snapshot(obj)
        self._watched.append((label, in_module, library, obj, snap))
        if depth > 0 or held:
            for key, child in snap.items() if isinstance(snap, dict) else enumerate(snap):
                if not isinstance(child, nn.Module):
                    self._watch(child, f"{label}.{key}" if attributes else f"{label}[{key!r}]", in_module, library, seen, depth - 1)

    def hidden_uses(self) -> list[HiddenStateUse]:
        """The watched random generators and iterators whose state differs from the snapshot now: the
        step drew from or advanced them."""
        return [
            HiddenStateUse(label, kind, restore is not None)
            for label, obj, kind, before, restore in self._hidden
            if not _same_contents(before, _hidden_state(obj)[1])
        ]

    def rewind(self) -> None:
        """Put every watched random generator back in its state before the trace (iterators cannot be)."""
        for _, _, _, before, restore in self._hidden:
            if restore is not None:
                restore(before)

    def changes(self) -> list[StateChange]:
        """What differs from the snapshots now, one :class:`StateChange` per changed object."""
        found = []
        for label, in_module, library, obj, old in self._watched:
            new = _snapshot(obj)
            diff = _difference(old, new, attributes=not isinstance(obj, _CONTAINERS))
            if diff is not None:
                what, added = diff
                assigned = None if isinstance(obj, _CONTAINERS) else _scalar_assignments(old, new)
                replay = None if assigned is None else functools.partial(_assign, obj, assigned)
                found.append(StateChange(label, what, any(_is_traced(v) for v in added), in_module, library,
                                         lambda obj=obj, old=old: _restore(obj, old), replay, assigned))
        return found


# ---------------------------------------------------------------------------------------- random state

_RANDOM_FUNCTIONS = (
    "random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
    "normalvariate", "betavariate", "expovariate", "triangular", "getrandbits",
)
_NUMPY_RANDOM_FUNCTIONS = (
    "random", "rand", "randn", "randint", "random_sample", "uniform", "normal", "choice", "permutation",
    "shuffle", "binomial", "poisson", "beta", "exponential",
)
_TORCH_SEEDING_FUNCTIONS = ("manual_seed", "seed", "set_rng_state")


class RandomStateUse:
    """What a traced step did with random state that only its Python sees: draws from Python's
    ``random`` module or numpy's global random state (:attr:`drew`), and calls that seed or set
    torch's generator (:attr:`seeded`: ``torch.manual_seed(s)`` in the step). Either happens once,
    when the step is traced: a draw's outcome (a LayerDrop decision, a SpecAugment mask built with
    ``np.random``) is kept by the graph and repeated by every call, and a seeding is not repeated, so
    later calls draw from another point of torch's stream than one device does.

    The Python and numpy states are compared before and after; while inside, the module-level
    functions of ``random``, ``numpy.random`` and torch's seeding functions note the innermost calling
    frame outside them, to say where (:attr:`where`). :meth:`restore` puts all three states back (a
    refused step draws and seeds nothing).
    """

    def __init__(self) -> None:
        self.where: list[str] = []
        self.seeded: list[str] = []
        self.drew = False
        self._numpy = sys.modules.get("numpy")
        self._states: tuple = ()
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "RandomStateUse":
        import random

        self._states = (
            random.getstate(),
            self._numpy.random.get_state() if self._numpy is not None else None,
            torch.random.get_rng_state(),
        )
        targets = [(random, n, self.where, False) for n in _RANDOM_FUNCTIONS]
        if self._numpy is not None:
            targets += [(self._numpy.random, n, self.where, False) for n in _NUMPY_RANDOM_FUNCTIONS]
        # torch's own code saves and restores the generator (checkpoint's recompute, fork_rng): only
        # the user's calls seed.
        targets += [(m, n, self.seeded, True) for m in (torch, torch.random) for n in _TORCH_SEEDING_FUNCTIONS]
        for module, name, notes, user_only in targets:
            original = getattr(module, name, None)
            if original is not None:
                setattr(module, name, self._noting(original, f"{module.__name__}.{name}", notes, user_only))
                self._patched.append((module, name, original))
        return self

    @staticmethod
    def _noting(original: Callable, label: str, notes: list, user_only: bool) -> Callable:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if len(notes) < 3 and not (user_only and _is_library_path(frame.f_code.co_filename)):
                notes.append(f"{label}() at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
            return original(*args, **kwargs)

        return call

    def __exit__(self, *exc: Any) -> None:
        import random

        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        before_random, before_numpy, _ = self._states
        self.drew = random.getstate() != before_random or (
            before_numpy is not None and not _same_numpy_state(before_numpy, self._numpy.random.get_state())
        )

    def restore(self) -> None:
        import random

        before_random, before_numpy, before_torch = self._states
        random.setstate(before_random)
        if before_numpy is not None:
            self._numpy.random.set_state(before_numpy)
        torch.random.set_rng_state(before_torch)


def _same_numpy_state(a: tuple, b: tuple) -> bool:
    # ("MT19937", keys array, pos, has_gauss, cached_gaussian)
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]
