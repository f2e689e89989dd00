"""Meta kernels for torch's fused optimizer ops that torch 2.13 ships without one.

An optimizer constructed with ``fused=True`` (Adam, AdamW, SGD, Adagrad; HuggingFace's
``optim="adamw_torch_fused"``) updates all parameters in one ATen op, ``aten._fused_adamw_`` and
friends. The traced step calls the ``tensor_lr`` overload (the learning rate stays a graph input,
see :func:`spmd_expand.trace.trace_step`), and torch registers a Meta (shape) kernel only for the
float-``lr`` overloads of Adam and AdamW. Without one, fake tensors cannot run the op: Inductor's
functionalization stopped the default lowering of every fused-optimizer step with
``UnsupportedOperatorException: aten._fused_adamw.tensor_lr``, and fused Adagrad could not be traced
at all.

The ops update their tensor lists in place and return nothing, so their Meta kernel checks the
arguments as torch's own ``meta__fused_adam_`` (``torch/_meta_registrations.py``) does and returns
nothing. The functional variants (``aten._fused_adamw.tensor_lr``, ...) need no kernel of their own:
their generated CompositeExplicitAutograd kernel clones the lists and calls the in-place op.

A kernel is registered only where torch has none, so a later torch that adds them keeps its own.
Importing :mod:`spmd_expand` registers them.
"""

from __future__ import annotations

import torch

__all__ = ["MISSING_META_KERNELS", "register_meta_kernels"]

# In-place fused optimizer ops (qualified overload names) that may lack a Meta kernel.
MISSING_META_KERNELS = (
    "aten::_fused_adam_.tensor_lr",
    "aten::_fused_adamw_.tensor_lr",
    "aten::_fused_sgd_",
    "aten::_fused_sgd_.tensor_lr",
    "aten::_fused_adagrad_",
    "aten::_fused_adagrad_.tensor_lr",
)

_library: "torch.library.Library | None" = None


def _check_lists(*args, **kwargs) -> None:
    """The Meta kernel of every op above: each positional argument is a list of tensors of one length."""
    lengths = set()
    for arg in args:
        torch._check(isinstance(arg, list), lambda: f"expected a list of tensors, got {type(arg).__name__}")
        if arg:
            lengths.add(len(arg))
    torch._check(len(lengths) <= 1, lambda: f"tensor lists of different lengths {sorted(lengths)}")


def register_meta_kernels() -> list[str]:
    """Register :func:`_check_lists` as the Meta kernel of each op of :data:`MISSING_META_KERNELS`
    that has none; returns the names registered (empty when called again)."""
    global _library
    registered = []
    for name in MISSING_META_KERNELS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
            continue
        if _library is None:
            _library = torch.library.Library("aten", "IMPL")
        _library.impl(name.split("::", 1)[1], _check_lists, "Meta")
        registered.append(name)
    return registered


register_meta_kernels()
