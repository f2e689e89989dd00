"""Eager DTensor code in a parallelized model's forward, run as one device would run it.

Under ``torch.compile(model, backend="spmd")`` Dynamo runs parts of a forward outside its graphs: a
function under ``torch._dynamo.disable`` / ``torch.compiler.disable``, a frame Dynamo skips, the call
at a graph break. Its values there are DTensors, so torch runs DTensor's eager rules, and those are
not held to one device's results: in torch 2.13 the gradients of ``F.mse_loss``, ``smooth_l1_loss``,
``huber_loss``, ``binary_cross_entropy`` and ``soft_margin_loss`` with ``reduction="mean"`` come out
W times one device's (their backward kernels divide by the local element count), a cross-entropy
with ``ignore_index`` averages the ranks' means, ``fill_diagonal_`` on a row-split tensor writes
nothing: wrong answers without an error.

:class:`ForwardMode` is :class:`~spmd_expand.forms.EqualForms` plus one rule for such calls. A torch
call seen outside Dynamo's tracing (``torch.compiler.is_compiling()`` false) with a DTensor among its
arguments is run on full values: each DTensor argument is redistributed to ``Replicate`` on its mesh
(all-gather of a shard, all-reduce of a partial value) and taken as its local tensor, the call runs on
plain tensors, and each tensor it returns comes back as a replicated DTensor on the first argument's
mesh. Every rank then computes what one device computes over the global batch, and autograd carries
the gradients back through ``redistribute``'s and ``to_local``'s backward to the arguments'
placements (every rank's gradient of a full value is the same, so a shard of it is this rank's). A
call that mutates a DTensor (a name ending in ``_``, ``__setitem__``, ``__iadd__`` and kin,
``out=``) writes the full result back into it in its own placements.

Not run this way: metadata reads (``size``, ``dim``, properties such as ``shape`` and ``grad``),
calls without DTensor arguments (their tensors are already full values: a mask the code builds), and
ATen operator calls (``torch.ops.aten.*``: what compiled graphs and their runners issue on local
tensors). The cost is every rank doing that call's compute on the whole batch, plus the gathers;
:class:`ForwardMode` warns once per call site, naming it, unless the call reads scalars only (``if
h.sum() > 0``, ``.item()`` at a graph break).

Aliases stay aliases, as on one device: a call that returns its argument itself (``contiguous()``,
``.to()`` of its own dtype) returns the DTensor, and a view op (``h[:, 0]``, ``narrow``,
``diagonal``) is run on the DTensors themselves where DTensor also gives a view with the same values,
so a later write through it reaches the tensor and autograd records it. Where DTensor copies instead
(a view across the split dim: ``h[0]`` of row-split rows), the view is the gathered copy, and a write
into either side is refused (``UnsupportedOpError``: it would reach one of them only). An in-place
change of shape (``unsqueeze_``) is DTensor's own, refused where DTensor has no rule.

Calls whose output's size depends on values (``torch.nonzero``, ``unique``, ``bincount``, ``h[mask]``),
which DTensor has no rule for while Dynamo captures, break the graph (``torch._dynamo.graph_break()``
from the mode): they then run this way, as one device.

A random op (dropout) run this way draws the whole tensor on each rank from that rank's default
generator: one device's draw, and the same on every rank, when the ranks' generators are in one state,
which ``spmd_expand.rng`` requires of compiled random ops too. A call that draws (its generator state
changed) checks that across the ranks, and raises ``DivergenceError`` where they differ (a seed per rank).
So does a random call without DTensor arguments (``noise = torch.randn(8, 3)``, then ``h + noise``):
each rank's tensor stands for the one tensor of one device, and is that only where the ranks drew alike.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .errors import UnsupportedOpError
from .forms import EqualForms, equal_valued_form
from .rank_check import check_ranks_agree
from .rng import GENERATOR_FIX, generator_state

__all__ = ["ForwardMode"]

# Calls that read metadata or autograd state, computing no value (``grad``: ``torch.autograd.grad``, whose
# inputs must stay the DTensors themselves): DTensor answers them for the global tensor, which is what one
# device sees.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "element_size", "get_device", "data_ptr",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "detach",
    "backward", "grad", "__len__", "__repr__", "__str__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__",
    "__get__", "__set__", "__delete__",
    "detach_", "share_memory_",
})
# In place, of the shape only (the same values): DTensor's own rule where it has one (see _call_eagerly).
_SHAPE_IN_PLACE = frozenset({
    "unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_", "resize_as_",
})
_INPLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift",
))
_OWN_FILES = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or ""


def _is_eager_dtensor_call(func: Callable, args: tuple, kwargs: dict) -> bool:
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or _name(func) in _METADATA:
        return False
    return any(isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs)))


# Calls whose output's size depends on the input's values (``torch.nonzero``, ``unique``, ``h[mask]``).
_SIZED_BY_VALUES = frozenset({
    "nonzero", "argwhere", "unique", "unique_consecutive", "bincount", "masked_select",
})


def _sized_by_values(func: Callable, args: tuple) -> bool:
    name = _name(func)
    if name in _SIZED_BY_VALUES or (name == "where" and len(args) == 1):
        return True
    if name == "__getitem__" and len(args) > 1:  # indexing with a boolean mask
        index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


# Torch calls that draw from the default generator (factories, in-place samplers, random layers), by the
# name a torch-function mode sees (``F.dropout`` is seen as ``dropout``, ``nn.init.normal_`` as ``normal_``).
_DRAWS = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
    "multinomial", "poisson", "binomial", "normal_", "uniform_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "bernoulli_", "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d",
    "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout",
    "feature_dropout_", "rrelu", "rrelu_", "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_",
})


def _may_draw(func: Callable) -> bool:
    """A call of the user's that may draw random numbers: named in :data:`_DRAWS`, not an ATen operator call
    (a compiled graph's runner), and not under a dispatch mode (the lowering's fake tensors have no draws)."""
    return (
        not isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        and _name(func) in _DRAWS
        and not is_in_torch_dispatch_mode()
    )


def _generator_states(device_type: str) -> tuple[str, ...]:
    """The default generators a call in the forward can draw from: the mesh's device's, and the CPU's."""
    return tuple(generator_state(d) for d in dict.fromkeys((device_type, "cpu")))


def _drawn_alike(mesh: DeviceMesh, func: Callable, call: Callable[[], Any]) -> Any:
    """``call()``; where it drew random numbers (a default generator's state changed), check first that
    the ranks of ``mesh`` drew from one state: each rank then holds one device's draw, the same on all.
    Costs two reads of the generator states (about 3 us each on CPU), and a store round trip if it drew.

    Raises:
        DivergenceError: on every rank, where the ranks' generators were in different states (a seed
            per rank, draws made on some ranks only), naming the call's line and each rank's state.
    """
    before = _generator_states(mesh.device_type)
    result = call()
    if _generator_states(mesh.device_type) != before:
        check_ranks_agree(
            f"the random generator state before {_name(func) or func} at {_call_site_text()}, outside Dynamo's "
            f"graphs (it draws random numbers)",
            list(before), [""] * len(before), mesh, fix=GENERATOR_FIX,
        )
    return result


def _mutated(func: Callable, args: tuple, kwargs: dict) -> list[int]:
    """Positions (in ``(args, kwargs)``'s leaves) of the DTensors the call writes."""
    name = _name(func)
    written = []
    if args and (name in _INPLACE_OPERATORS or name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))):
        written += pytree.tree_leaves(args[0])  # a tensor, or the list a _foreach_*_ op writes
    written += [t for t in pytree.tree_leaves(kwargs.get("out")) if isinstance(t, torch.Tensor)]
    leaves = pytree.tree_leaves((args, kwargs))
    return [i for i, leaf in enumerate(leaves) if isinstance(leaf, DTensor) and any(leaf is w for w in written)]


def _full(value: Any) -> Any:
    """A DTensor's full value as a plain tensor (every rank the same); anything else as it is."""
    if not isinstance(value, DTensor):
        return value
    mesh = value.device_mesh
    return value.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()


def _call_site() -> Any:
    """The innermost frame outside torch and spmd_expand (the user's call), or None."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame = frame.f_back
    return frame


def _call_site_text() -> str:
    """``file:line`` of :func:`_call_site`'s frame, for messages."""
    frame = _call_site()
    return "an unknown line" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def run_as_one_device(func: Callable, args: tuple, kwargs: dict, form: Optional[Callable] = None) -> Any:
    """``func(*args, **kwargs)`` (or its equal-valued ``form``) on the DTensor arguments' full values.

    Returns what the call returns, each tensor in it a replicated DTensor on the first DTensor
    argument's mesh, except where one device's call returns an alias of an argument: an argument
    returned as itself (``contiguous()``, ``.to()`` of its own dtype) is that DTensor, and a view of
    one (``h[:, 0]``, ``narrow``, ``diagonal``) is :func:`_dtensor_views`'s. A DTensor the call mutates
    receives the full result in its own placements and is returned as itself. Collectives: one
    redistribute to ``Replicate`` per DTensor argument.

    Raises:
        UnsupportedOpError: the call writes into a view that is a copy here (:func:`_refuse_stale_aliases`).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    dtensors = [t for t in leaves if isinstance(t, DTensor)]
    mesh = dtensors[0].device_mesh
    written = _mutated(func, args, kwargs)
    _refuse_stale_aliases(func, [leaves[i] for i in written])
    # (A gathered value the call writes is copied first: to_local's output is a custom Function's, which
    # autograd does not let a view of be written in place.)
    local = [_full(t).clone() if i in written else _full(t) for i, t in enumerate(leaves)]
    local_args, local_kwargs = pytree.tree_unflatten(local, spec)
    call = form if form is not None else func
    if isinstance(call, functools.partial):  # a form holding a tensor of the call (l1_loss's weight)
        call = functools.partial(call.func, *map(_full, call.args), **{k: _full(v) for k, v in call.keywords.items()})
    # Each rank draws the whole tensor of a random call: one device's draw if the ranks drew alike.
    result = _drawn_alike(mesh, func, lambda: call(*local_args, **local_kwargs))
    for i in written:
        target: DTensor = leaves[i]
        full = DTensor.from_local(local[i], target.device_mesh, [Replicate()] * target.device_mesh.ndim, run_check=False)
        target.copy_(full.redistribute(target.device_mesh, target.placements))
    inputs = {i: local[i] for i, leaf in enumerate(leaves) if isinstance(leaf, DTensor)}
    itself = {id(full): leaves[i] for i, full in inputs.items()}
    outputs = [v for v in pytree.tree_leaves(result) if isinstance(v, torch.Tensor) and id(v) not in itself]
    if not written and any(_same_storage(v, full) for v in outputs for full in inputs.values()):
        views = _dtensor_views(func, args, kwargs, result)
        if views is not None:
            _track_views_of_stale_aliases([leaves[i] for i in inputs], views)
            return views
        bases = [leaves[i] for i in inputs]
    else:
        bases = []

    def wrap(value: Any) -> Any:
        if id(value) in itself:
            return itself[id(value)]
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            out = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
            # A view on one device, a copy here: writes to either must not happen.
            _add_stale_aliases([(weakref.ref(base), weakref.ref(out)) for base in bases])
            return out
        return value

    return pytree.tree_map(wrap, result)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _dtensor_views(func: Callable, args: tuple, kwargs: dict, full_result: Any) -> Any:
    """The call on the DTensors themselves, where it is a view op whose results DTensor also gives as
    views (each result's local tensor in the storage of an argument's) with the full values of
    ``full_result``: autograd then sees a write through them as a write to the tensor they view, as on
    one device. None where DTensor copies instead (a view across a split dim) or raises."""
    try:
        views = func(*args, **kwargs)
    except Exception:
        return None
    sources = [t._local_tensor for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
    got, want = pytree.tree_leaves(views), pytree.tree_leaves(full_result)
    if len(got) != len(want):
        return None
    if [isinstance(full, torch.Tensor) for full in want] != [isinstance(view, DTensor) for view in got]:
        return None
    pairs = [(view, full) for view, full in zip(got, want) if isinstance(view, DTensor)]
    # (Every rank gathers every view before any decides: the decision then holds on all ranks alike.)
    equal = [torch.equal(view.full_tensor(), full) for view, full in pairs]
    if not all(equal) or not all(any(_same_storage(view._local_tensor, source) for source in sources) for view, _ in pairs):
        return None
    return views


# (base DTensor, its "view" DTensor) where one device's call returns a view and the fallback a copy: a
# write to either would not reach the other here. Pruned as the tensors are freed.
_STALE_ALIASES: list[tuple[weakref.ref, weakref.ref]] = []


def _prune_stale_aliases() -> None:
    _STALE_ALIASES[:] = [(b, v) for b, v in _STALE_ALIASES if b() is not None and v() is not None]


def _add_stale_aliases(pairs: list[tuple[weakref.ref, weakref.ref]]) -> None:
    """Record ``pairs``; the freed ones go when the list has grown past 1,024 (not on every view op)."""
    if pairs and len(_STALE_ALIASES) > 1024:
        _prune_stale_aliases()
    _STALE_ALIASES.extend(pairs)


def _track_views_of_stale_aliases(arguments: list, views: Any) -> None:
    """A view (``v[1:]``) of a tensor that is itself a gathered copy standing for a view (``v = h[0]``,
    ``h`` row-split) is a view of ``h`` on one device too: pair it with ``h``, so writes through it are
    refused as writes through ``v`` are."""
    bases = [b for b, v in _STALE_ALIASES if any(v() is a for a in arguments)]  # (a freed view matches nothing)
    new = [view for view in pytree.tree_leaves(views) if isinstance(view, DTensor)]
    _add_stale_aliases([(base, weakref.ref(view)) for base in bases for view in new])


def _refuse_stale_aliases(func: Callable, targets: list) -> None:
    """Raise where the call writes into one side of a :data:`_STALE_ALIASES` pair."""
    if not targets:
        return
    _prune_stale_aliases()
    for base, view in _STALE_ALIASES:
        if any(t is base() or t is view() for t in targets):
            where = _call_site_text()
            raise UnsupportedOpError(
                f"torch.compile(backend=\"spmd\"): {_name(func) or func} at {where} writes in place into a "
                f"tensor that has a view, or is one, taken in code outside Dynamo's graphs across the dim the "
                f"ranks split (placements {tuple(base().placements)}). On one device the write reaches both; "
                f"spmd_expand ran that view as a gathered copy, so it would reach one of them only.\n"
                f"  fix: write out of place (`h = h.clone()` before the write, or `torch.where`/`index_put` "
                f"instead of a write through the view), or let Dynamo compile that code"
            )


def _warn(func: Callable, frame: Any) -> None:
    """One warning at the user's line (Python's warning filters show it once per line by default)."""
    where = (frame.f_code.co_filename, frame.f_lineno, frame.f_globals) if frame is not None else ("<unknown>", 0, {})
    warnings.warn_explicit(
        f"torch.compile(backend=\"spmd\"): {_name(func) or func} ran on DTensors outside Dynamo's graphs "
        f"(torch._dynamo.disable, torch.compiler.disable, a frame Dynamo skipped, or the call at a graph break), "
        f"where DTensor's eager rules can give other values than one device. spmd_expand runs it as one device "
        f"would: its DTensor arguments gathered to their full values on every rank (right values; that call's "
        f"compute is done for the whole batch on each rank). Let Dynamo compile it for data-parallel speed "
        f"(TORCH_LOGS=graph_breaks shows why it did not)",
        UserWarning, where[0], where[1], module=where[2].get("__name__", "<unknown>"),
        registry=where[2].setdefault("__warningregistry__", {}),
    )


class ForwardMode(EqualForms):
    """The torch-function mode of a parallelized model's forward under ``torch.compile(backend="spmd")``:
    :class:`~spmd_expand.forms.EqualForms` while Dynamo traces, and outside its tracing a torch call on
    DTensors run as one device would (:func:`run_as_one_device`), warning at the user's line, and a
    random call without DTensor arguments checked to draw alike on the ranks of ``mesh``
    (:func:`_drawn_alike`)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        form = equal_valued_form(func, args, kwargs)
        if not torch.compiler.is_compiling():
            return _call_eagerly(func, args, kwargs, form, self.mesh)
        if _sized_by_values(func, args):
            # DTensor has no rule for an output sized by the values (Dynamo would stop with a sharding
            # error while it captures): break the graph, so the call runs eagerly, as one device.
            torch._dynamo.graph_break()
        return form(*args, **kwargs)


# Dynamo inlines the handler where it traces the forward, and must not compile it as a frame of its own:
# called from code Dynamo runs eagerly (a frame it skipped after an exception), the handler was traced
# as a frame with is_compiling() true, taking the traced path for an eager call (and in torch 2.13 that
# compiled handler returned a dtype for `x.ndim`). The eager path itself runs with Dynamo off.
torch._dynamo.eval_frame.skip_code(ForwardMode.__torch_function__.__code__)


@torch._dynamo.disable
def _call_eagerly(func: Callable, args: tuple, kwargs: dict, form: Callable, mesh: DeviceMesh) -> Any:
    if not _is_eager_dtensor_call(func, args, kwargs):
        if _may_draw(func):  # a plain tensor drawn here stands for one device's: the ranks must draw alike
            return _drawn_alike(mesh, func, lambda: form(*args, **kwargs))
        return form(*args, **kwargs)
    if _name(func) in _SHAPE_IN_PLACE:
        try:
            return form(*args, **kwargs)
        except NotImplementedError as e:  # DTensor has no rule: a DTensor's shape cannot change in place
            where = _call_site_text()
            raise UnsupportedOpError(
                f"torch.compile(backend=\"spmd\"): {_name(func)} at {where} changes the shape of a DTensor in place "
                f"in code outside Dynamo's graphs, which DTensor has no rule for ({e}).\n"
                f"  fix: use the out-of-place op (`h = h.{_name(func)[:-1]}(...)`), or let Dynamo compile that code"
            ) from e
    if any(t.numel() > 1 for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DTensor)):
        _warn(func, _call_site())  # (not for a scalar read at a graph break: `if loss > 0`, `.item()`)
    return run_as_one_device(func, args, kwargs, form)
