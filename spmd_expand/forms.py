"""Equal-valued forms: calls the trace records as other ops that compute the same values.

Each form answers one call of the user's step (seen by a torch-function mode, before any ATen op runs)
with a function of the same arguments whose ops every stage can handle, where torch's own path would
stop or go wrong:

* ops with no sharding rule, in DTensor or here: an adaptive average pool to size 1 (ATen restrides a
  channels-last result with ``as_strided_``), ``F.embedding_bag`` over fixed-size bags, ``F.bilinear``
  (``_trilinear``), a matrix's ``fill_diagonal_`` (``as_strided``);
* ops whose backward needs a concrete batch size: ``F.affine_grid``, ``F.interpolate`` with
  ``antialias=True``;
* an op whose traced form in torch 2.13 is wrong: ``F.multilabel_margin_loss``, and ``F.l1_loss``
  with ``weight=``, which torch hands a torch-function mode without the weight;
* a fast path the trace cannot take: ``nn.TransformerEncoder``'s nested-tensor path in evaluation
  (:func:`encoder_nested_fast_path`, a patched ``forward`` rather than a torch-function form).

:func:`equal_valued_form` picks the form; ``trace._StepMode`` uses it while ``spmd.compile`` traces the
step, and :class:`EqualForms` applies it around a parallelized model's forward under
``torch.compile(backend="spmd")``, where Dynamo traces the mode. Each form's docstring says what it
replaces and why; the module-zoo and loss tests compare them with one device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["EqualForms", "encoder_nested_fast_path", "equal_valued_form", "equal_forms_patched"]

# The functions the forms answer, as torch defines them (``equal_forms_patched`` replaces the attributes
# for a while; the forms compare calls with these).
_PATCHED = [(F, name) for name in ("embedding_bag", "bilinear", "multilabel_margin_loss", "affine_grid", "interpolate")]
_PATCHED += [(F, f"adaptive_avg_pool{d}d") for d in (1, 2, 3)] + [(torch.Tensor, "fill_diagonal_")]
_ORIGINAL = {name: getattr(owner, name) for owner, name in _PATCHED}


def _mean_over_last(dims: int) -> Callable:
    def mean_over_pooled_dims(input: torch.Tensor, output_size: Any) -> torch.Tensor:
        return input.mean(tuple(range(-dims, 0)), keepdim=True)

    return mean_over_pooled_dims


# Adaptive average pooling to size 1 (a global average pool: ``nn.AdaptiveAvgPool1d(1)`` over tokens in
# Swin's pooler, ``AdaptiveAvgPool2d(1)`` in ResNets): pooled dims, and the mean that computes it.
_ADAPTIVE_AVG_POOLS = {_ORIGINAL[f"adaptive_avg_pool{d}d"]: (d, _mean_over_last(d)) for d in (1, 2, 3)}


def _global_average_pool(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """``mean`` over the pooled dims for an adaptive average pool to size 1, or None.

    ATen computes that pool (``adaptive_avg_pool2d``/``3d``, CompositeImplicit, and ``1d`` through
    ``2d``) as ``input.mean(dims, keepdim=True)``, then, for a channels-last input (a transposed
    ``(batch, channels, tokens)`` tensor is one), ``as_strided_`` to channels-last strides. The mean
    is the same values; the restride has no sharding rule, and autograd records its backward as
    ``as_strided`` into a zero buffer of the storage's size, which none has either. Traced as the
    mean alone, both are gone; only the output's strides differ (contiguous).
    """
    dims, mean = _ADAPTIVE_AVG_POOLS.get(func, (0, None))
    if mean is None:
        return None
    output_size = args[1] if len(args) > 1 else kwargs.get("output_size")
    sizes = (output_size,) * dims if isinstance(output_size, int) else tuple(output_size or ())
    if len(sizes) != dims or any(type(size) is not int or size != 1 for size in sizes):
        return None
    return mean


def _embedding_bag_of_rows(
    input: torch.Tensor,
    weight: torch.Tensor,
    offsets: Optional[torch.Tensor] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: Optional[torch.Tensor] = None,
    include_last_offset: bool = False,
    padding_idx: Optional[int] = None,
) -> torch.Tensor:
    """``F.embedding_bag`` of a 2-D ``(bags, bag_size)`` input as ``F.embedding`` and a reduction over
    each bag: ``(bags, dim)``. Entries equal to ``padding_idx`` are left out of every mode (a bag of
    padding alone gives zeros), as ATen's ``_embedding_bag`` does."""
    rows = F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1)
    kept = None if padding_idx is None else (input != padding_idx % weight.size(0)).unsqueeze(-1)
    if mode == "max":
        if kept is None:
            return rows.max(1).values
        return rows.masked_fill(~kept, float("-inf")).max(1).values.masked_fill(~kept.any(1), 0)
    total = (rows if kept is None else rows * kept).sum(1)
    if mode == "sum":
        return total
    return total / (input.size(1) if kept is None else kept.sum(1).clamp(min=1))


def _embedding_bag(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """:func:`_embedding_bag_of_rows` for ``F.embedding_bag`` over a 2-D input (``nn.EmbeddingBag(x)``
    with fixed-size bags, as in DLRM), or None.

    ``F.embedding_bag`` flattens a 2-D input and builds its bag offsets with ``arange(0, numel,
    bag_size)``: offsets into the *global* flattened batch, which no rank's shard of the batch can use,
    and ATen's fused ``_embedding_bag`` has no sharding rule. The embedding and the per-bag reduction
    split on the batch dim like any other rows (and column-wise under tensor parallelism). The fused
    kernel does not hold the ``(bags, bag_size, dim)`` rows that this form does. A 1-D input with
    explicit ``offsets`` is not rewritten (and is refused by the op's missing rule). Calls
    ``F.embedding_bag`` itself refuses (a ``mode`` it does not know, ``per_sample_weights`` outside
    ``"sum"``, ...) keep its own error.
    """
    if func is not _ORIGINAL["embedding_bag"]:
        return None
    names = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights")
    bound = {**dict(zip(names, args)), **kwargs}
    input, weight, weights = bound.get("input"), bound.get("weight"), bound.get("per_sample_weights")
    mode = bound.get("mode", "mean")
    usable = (
        isinstance(input, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and input.dim() == 2
        and not input.is_nested
        and not input.is_floating_point()
        and weight.dim() == 2
        and bound.get("offsets") is None
        and mode in ("sum", "mean", "max")
        and (weights is None or (mode == "sum" and weights.shape == input.shape))
        and not (mode == "max" and (bound.get("scale_grad_by_freq") or bound.get("sparse")))
    )
    return _embedding_bag_of_rows if usable else None


def _bilinear_as_einsum(
    input1: torch.Tensor, input2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``F.bilinear``: ``y[..., o] = sum_ij x1[..., i] W[o, i, j] x2[..., j] + b[o]``, as ``einsum``."""
    out = torch.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias


def _bilinear(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """``einsum`` for ``F.bilinear`` (``nn.Bilinear``), or None: ATen's ``_trilinear`` has no sharding
    rule; the einsum's matmuls split on the batch dims. Same values up to summation order."""
    return _bilinear_as_einsum if func is _ORIGINAL["bilinear"] else None


def _multilabel_margin_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    size_average: Optional[bool] = None,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.multilabel_margin_loss``, as ATen's kernel defines it: row ``b``'s targets are ``target[b]``
    up to its first negative entry, and its loss is ``sum_{j target, i not target} relu(1 - x[j] +
    x[i]) / C``; then ``reduction`` over the rows. ``input``/``target``: ``(C,)`` or ``(N, C)``.

    Traced in place of torch's: make_fx runs torch's Python decomposition of
    ``multilabel_margin_loss_forward`` (``torch/_decomp/decompositions.py``), which in torch 2.13 still
    counts the slots after a target row's ``-1`` end marker as targets (pytorch/pytorch#141017, fixed
    after 2.13), so the traced loss and gradients differed from eager's, on one rank as on many.
    """
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    x, y = (input, target) if input.dim() == 2 else (input.unsqueeze(0), target.unsqueeze(0))
    classes = torch.arange(x.size(1), device=x.device)
    slots = (y >= 0).cumprod(1).bool()  # (N, slot): before the row's first negative entry
    is_target = ((y.unsqueeze(-1) == classes) & slots.unsqueeze(-1)).any(1)  # (N, C)
    target_scores = x.gather(1, y.clamp(min=0))  # (N, slot)
    margins = torch.relu(1 - target_scores.unsqueeze(-1) + x.unsqueeze(1))  # (N, slot, C)
    rows = (margins * (slots.unsqueeze(-1) & ~is_target.unsqueeze(1))).sum((1, 2)) / x.size(1)
    if reduction == "mean":
        return rows.mean()
    if reduction == "sum":
        return rows.sum()
    return rows if input.dim() == 2 else rows[0]


def _multilabel_margin(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """:func:`_multilabel_margin_loss` for ``F.multilabel_margin_loss`` (``nn.MultiLabelMarginLoss``)."""
    return _multilabel_margin_loss if func is _ORIGINAL["multilabel_margin_loss"] else None


def _fill_diagonal_(input: torch.Tensor, fill_value: Any, wrap: bool = False) -> torch.Tensor:
    """``input.fill_diagonal_(fill_value)`` of a matrix, as a fill of its ``diagonal()`` view."""
    input.diagonal().fill_(fill_value)
    return input


def _fill_diagonal(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """:func:`_fill_diagonal_` for ``Tensor.fill_diagonal_`` on a matrix (a contrastive loss masking
    each row's similarity to itself), or None. ATen writes the diagonal through ``as_strided``, which
    has no sharding rule (and whose strides would not describe a shard); ``diagonal`` does. Only where
    the two agree: a 2-D tensor, and ``wrap`` off or a square one (a tall matrix with ``wrap``
    starts the diagonal again below it)."""
    if func is not _ORIGINAL["fill_diagonal_"] or not args or not isinstance(args[0], torch.Tensor):
        return None
    input, wrap = args[0], (args[2] if len(args) > 2 else kwargs.get("wrap", False))
    if input.dim() != 2 or (wrap and input.size(0) > input.size(1) + 1):
        return None
    return _fill_diagonal_


def _normalized_coordinates(steps: int, align_corners: bool, like: torch.Tensor) -> torch.Tensor:
    """The ``steps`` sample positions of one axis in ``[-1, 1]``, as ATen's ``affine_grid`` spaces them
    (``linspace_from_neg_one``): the corner pixels' centers with ``align_corners``, else their edges."""
    if steps <= 1:
        return torch.zeros(1, dtype=like.dtype, device=like.device)
    line = torch.linspace(-1, 1, steps, dtype=like.dtype, device=like.device)
    return line if align_corners else line * (steps - 1) / steps


def _affine_grid_of(theta: torch.Tensor, size: Sequence[int], align_corners: Optional[bool] = None) -> torch.Tensor:
    """``F.affine_grid``: the base grid of normalized ``(x, y[, z], 1)`` positions, ``(*spatial, k + 1)``,
    times each ``theta`` (``(N, k, k + 1)``): ``(N, *spatial, k)``. ``align_corners=None`` is False, as
    in torch."""
    spatial = [int(n) for n in size[2:]]
    axes = [_normalized_coordinates(n, bool(align_corners), theta) for n in spatial]  # z, y, x order
    positions = torch.meshgrid(*axes, indexing="ij")
    base = torch.stack([*reversed(positions), torch.ones_like(positions[0])], dim=-1)
    return (base.reshape(1, -1, len(spatial) + 1) @ theta.transpose(1, 2)).unflatten(1, spatial)


def _affine_grid(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """:func:`_affine_grid_of` for ``F.affine_grid`` (spatial transformer networks), or None. The
    backward of ATen's ``affine_grid_generator`` takes the grid's size as concrete integers, so a
    batch size that is symbolic (as the trace keeps it) stopped ``loss.backward()``. Only a 4-D or
    5-D size with integer spatial dims and a matching ``theta``; anything else keeps torch's path (and
    its own errors)."""
    if func is not _ORIGINAL["affine_grid"]:
        return None
    theta = args[0] if args else kwargs.get("theta")
    size = args[1] if len(args) > 1 else kwargs.get("size")
    if not isinstance(theta, torch.Tensor) or not theta.is_floating_point() or theta.dim() != 3 or size is None:
        return None
    k = len(size) - 2
    if k not in (2, 3) or tuple(theta.shape[1:]) != (k, k + 1) or not all(type(n) is int for n in size[2:]):
        return None
    return _affine_grid_of


def _antialiased_axis(n: int, axis: int, like: torch.Tensor, mode: str, align_corners: Any, resize: dict) -> torch.Tensor:
    """The ``(n, out)`` weights of ``F.interpolate(..., antialias=True)`` along one spatial ``axis``
    (0: height, 1: width) of a length-``n`` axis: torch's own kernel applied to the ``n`` unit
    vectors. The other axis has length 2 and keeps it (an identity); length 1 there takes another
    path in torch 2.13's kernel that does not give the separable weights."""
    shape = [1, n, 2, 2]
    shape[2 + axis] = n
    basis = torch.eye(n, dtype=like.dtype, device=like.device).reshape(1, n, *((n, 1) if axis == 0 else (1, n))).expand(shape)
    kwargs = {}
    if resize["size"] is not None:
        size = [2, 2]
        size[axis] = resize["size"][axis]
        kwargs["size"] = tuple(size)
    else:
        scale = [1.0, 1.0]
        scale[axis] = resize["scale_factor"][axis]
        kwargs.update(scale_factor=tuple(scale), recompute_scale_factor=resize["recompute_scale_factor"])
    with torch.no_grad():
        weights = _ORIGINAL["interpolate"](basis, mode=mode, align_corners=align_corners, antialias=True, **kwargs)
    return weights[0, :, :, 0] if axis == 0 else weights[0, :, 0, :]


def _per_axis(value: Any) -> Optional[tuple]:
    """``F.interpolate``'s ``size`` or ``scale_factor`` as one entry per spatial axis (a number is both)."""
    return None if value is None else (tuple(value) if isinstance(value, (list, tuple)) else (value, value))


def _antialiased_resize(
    input: torch.Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest", align_corners: Any = None,
    recompute_scale_factor: Any = None, antialias: bool = False,
) -> torch.Tensor:
    """``F.interpolate(input, ..., antialias=True)`` of an ``(N, C, H, W)`` input in bilinear or
    bicubic mode, as the separable resampling it is: ``einsum("nchw,ho,wp->ncop", input, A, B)`` with
    each axis' weights from :func:`_antialiased_axis` (equal up to float32 rounding, 7e-7 seen)."""
    resize = {"size": _per_axis(size), "scale_factor": _per_axis(scale_factor), "recompute_scale_factor": recompute_scale_factor}
    height = _antialiased_axis(input.shape[2], 0, input, mode, align_corners, resize)
    width = _antialiased_axis(input.shape[3], 1, input, mode, align_corners, resize)
    return torch.einsum("nchw,ho,wp->ncop", input, height, width)


def _antialiased_interpolate(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """:func:`_antialiased_resize` for ``F.interpolate(..., mode="bilinear" | "bicubic", antialias=True)``
    of a 4-D input with integer spatial sizes, or None. The backward ops of ATen's antialiased
    kernels (``_upsample_bilinear2d_aa_backward``, ``_upsample_bicubic2d_aa_backward``) take the
    input's size as concrete integers: with the trace's symbolic batch size one kept the global batch
    size where a rank has its own rows, the other failed inside torch."""
    if func is not _ORIGINAL["interpolate"]:
        return None
    names = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
    bound = {**dict(zip(names, args)), **kwargs}
    input = bound.get("input")
    if not bound.get("antialias") or bound.get("mode") not in ("bilinear", "bicubic"):
        return None
    if not isinstance(input, torch.Tensor) or input.dim() != 4 or not all(type(n) is int for n in input.shape[2:]):
        return None
    size, scale = _per_axis(bound.get("size")), _per_axis(bound.get("scale_factor"))
    if (size is None) == (scale is None):
        return None  # torch's own error
    # torch 2.13's kernels to an output width of 1 are not the separable resampling (344 of the
    # 7,174 small shapes and settings tried differ, all of them width 1; every other one agrees to
    # 1e-6): keep torch's path (and its error) there.
    width = size[1] if size is not None else math.floor(input.shape[3] * scale[1])
    if width == 1:
        return None
    return _antialiased_resize


_L1_LOSS = F.l1_loss


def _weighted_l1_loss(
    input: torch.Tensor, target: torch.Tensor, size_average: Any = None, reduce: Any = None, reduction: str = "mean",
    *, weight: torch.Tensor,
) -> torch.Tensor:
    """``F.l1_loss(input, target, reduction=..., weight=weight)`` as torch 2.13 computes it: the
    weighted absolute errors, summed, or summed over the weights' sum for ``"mean"``. Not a call of
    ``F.l1_loss`` itself: the trace stacks other torch-function modes below this one, and each would
    drop the weight again (tried: the 2-rank weighted L1 tests fail)."""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if weight.size() != input.size():
        raise ValueError("Weights and input must have the same size.")
    expanded_input, expanded_target = torch.broadcast_tensors(input, target)
    errors = torch.abs(expanded_input - expanded_target) * weight
    if reduction == "none":
        return errors
    if reduction == "sum":
        return errors.sum()
    if reduction == "mean":
        return errors.sum() / weight.sum()
    raise ValueError(f"{reduction} is not a valid value for reduction for weighted L1 loss.")


def _l1_weight_dropped(func: Callable, args: tuple, kwargs: dict) -> Optional[Callable]:
    """:func:`_weighted_l1_loss` with the ``weight=`` of an ``F.l1_loss`` call, or None (no weight).

    torch 2.13's ``F.l1_loss`` hands a torch-function mode its call without ``weight`` (its
    ``handle_torch_function`` passes the other keywords only), so every mode, the trace's included,
    computed the unweighted loss where one device weighs it: a silent wrong answer. The weight is read
    from the ``l1_loss`` frame that called the mode, a few frames up."""
    if func is not _L1_LOSS or "weight" in kwargs:
        return None
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is _L1_LOSS.__code__:
            weight = frame.f_locals.get("weight")
            return None if weight is None else functools.partial(_weighted_l1_loss, weight=weight)
        frame = frame.f_back
    return None


def equal_valued_form(func: Callable, args: tuple, kwargs: dict) -> Callable:
    """``func``, or a function computing the same values from the same arguments with ops that have
    sharding rules (:func:`_global_average_pool`, :func:`_embedding_bag`, :func:`_bilinear`,
    :func:`_fill_diagonal`), that traces with a symbolic batch size (:func:`_affine_grid`,
    :func:`_antialiased_interpolate`), or whose
    traced form in torch is wrong (:func:`_multilabel_margin`) or loses an argument
    (:func:`_l1_weight_dropped`)."""
    for form in (
        _global_average_pool, _embedding_bag, _bilinear, _fill_diagonal, _affine_grid, _antialiased_interpolate,
        _multilabel_margin, _l1_weight_dropped,
    ):
        replacement = form(func, args, kwargs)
        if replacement is not None:
            return replacement
    return func


class EqualForms(TorchFunctionMode):
    """Records the calls :func:`equal_valued_form` rewrites in their equal forms, and every other call
    as it is: the part of ``trace._StepMode`` that ``torch.compile(backend="spmd")`` needs, where
    Dynamo (tracing this mode) runs DTensor's rules, which lack the fused kernels these avoid."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return equal_valued_form(func, args, kwargs)(*args, **kwargs)


def _applying_forms(original: Callable) -> Callable:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return equal_valued_form(original, args, kwargs)(*args, **kwargs)

    return call


@contextlib.contextmanager
def equal_forms_patched() -> Iterator[None]:
    """The forms as the attributes torch code calls (``F.embedding_bag``, ``Tensor.fill_diagonal_``,
    ...), restored on exit: for code that runs where no torch-function mode can be active. A forward
    that activation checkpointing (``torch.utils.checkpoint``) re-runs inside ``backward()`` is such
    code: a mode is off while its own handler runs, and ``backward()`` is itself a call a mode
    handles. Without the forms there, the re-run records other ops than the forward did, and
    checkpoint refuses it ("Recomputed values ... have different metadata")."""
    own = {name: name in vars(owner) for owner, name in _PATCHED}  # else inherited (Tensor's, from TensorBase)
    try:
        for owner, name in _PATCHED:
            setattr(owner, name, _applying_forms(_ORIGINAL[name]))
        yield
    finally:
        for owner, name in _PATCHED:
            if own[name]:
                setattr(owner, name, _ORIGINAL[name])
            else:
                delattr(owner, name)


# ------------------------------------------------------------------ nn.TransformerEncoder's fast path
_ENCODER_FORWARD = nn.TransformerEncoder.forward


def _takes_nested_path(encoder: nn.TransformerEncoder, src: Any, mask: Any, padding_mask: Any, grad_enabled: bool, consulted: dict) -> bool:
    """Whether one device's ``encoder(src, mask, src_key_padding_mask=padding_mask)`` would run on a
    nested tensor: the conditions of torch 2.13's ``TransformerEncoder.forward`` (torch/nn/modules/
    transformer.py) except its data-dependent mask check (:func:`encoder_nested_fast_path` makes that
    one a graph value) and its ``has_torch_function`` test, which every trace meets (its modes are
    active) and one device's plain tensors do not.

    Grad mode inside the trace is on unless the step turned it off; where that decides, the caller's
    ``grad_enabled`` does. ``consulted`` records the global switches read (``"grad_mode"``,
    ``"mha_fastpath"``: ``torch.backends.mha.get_fastpath_enabled()``) and their values: the graph
    depends on them. (The encoder's own settings are module attributes, guarded as the trace reads them.)
    """
    layers = getattr(encoder, "layers", None)
    if not isinstance(src, torch.Tensor) or not layers or not isinstance(padding_mask, torch.Tensor):
        return False
    first = layers[0]
    consulted["mha_fastpath"] = torch.backends.mha.get_fastpath_enabled()
    if not (consulted["mha_fastpath"] and getattr(encoder, "use_nested_tensor", False)):
        return False
    if first.training or src.dim() != 3 or src.is_nested or mask is not None or torch.is_autocast_enabled():
        return False
    supported = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    if src.device.type not in supported:
        return False
    attn = first.self_attn
    tensors = (
        src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias,
        first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
        first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias,
    )
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        consulted["grad_mode"] = grad_enabled
        return not grad_enabled
    return True


@contextlib.contextmanager
def encoder_nested_fast_path(grad_enabled: bool) -> Iterator[dict]:
    """``nn.TransformerEncoder.forward`` computing what one device's nested-tensor fast path returns,
    while the step is traced; restored on exit. Yields the global switches the choice read and their
    values (:func:`_takes_nested_path`; empty: no encoder with a padding mask ran), for guards.

    In evaluation (the first layer in ``eval()``, no gradient needed, a ``src_key_padding_mask``, no
    ``mask``, batch-first layers) one device runs the encoder on a nested tensor of each sample's
    tokens and pads the result with zeros, before the final ``norm``: a padded position comes out as
    ``norm(0)``, where the regular path (the only one a trace can take: torch leaves the fast path when a
    torch-function mode is active) computes a value there. A mean over every position (an unmasked
    pooling, a distillation loss against a frozen encoder) then differed from one device, silently.

    Here the regular path runs and its padded positions are set to zero before ``norm``, as the nested
    path does. The valid positions are the same values up to rounding (~5e-7). torch's own conditions are
    :func:`_takes_nested_path`'s; its mask check (each sample's tokens first, padding after, over the
    whole batch, when ``encoder.mask_check``) is a graph value that picks either result, and without it
    the nested path reads each sample's first ``n`` tokens, ``n`` the count of unpadded ones, which is what
    runs here too.
    """
    consulted: dict = {}

    @functools.wraps(_ENCODER_FORWARD)
    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        if not _takes_nested_path(self, src, mask, src_key_padding_mask, grad_enabled, consulted):
            return _ENCODER_FORWARD(self, src, mask, src_key_padding_mask, is_causal)
        padding = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=None, other_name="mask",
            target_type=src.dtype,
        )
        keep = padding.logical_not()  # (batch, seq): a sample's tokens
        without_norm = copy.copy(self)
        without_norm._modules = {**self._modules, "norm": None}
        if getattr(self, "mask_check", True):
            regular = _ENCODER_FORWARD(without_norm, src, mask, src_key_padding_mask, is_causal)
            # torch's _nested_tensor_from_mask_left_aligned over the whole batch: no token after padding.
            aligned = (keep[:, 1:] & ~keep[:, :-1]).sum() == 0
            out = regular.masked_fill((~keep & aligned).unsqueeze(-1), 0.0)
        else:
            # What the nested tensor holds: each sample's first `count` positions.
            first_tokens = torch.arange(keep.size(1), device=keep.device) < keep.sum(1, keepdim=True)
            nested = _ENCODER_FORWARD(without_norm, src, mask, ~first_tokens, is_causal)
            out = nested.masked_fill((~first_tokens).unsqueeze(-1), 0.0)
        return self.norm(out) if self.norm is not None else out

    nn.TransformerEncoder.forward = forward
    try:
        yield consulted
    finally:
        nn.TransformerEncoder.forward = _ENCODER_FORWARD
