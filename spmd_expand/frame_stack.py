"""Headroom on CPython's frame stack for the compiler's long, deep calls (tracing, lowering).

CPython (3.11 and later) keeps the frames of Python calls in a per-thread stack of memory chunks:
16 KiB first, later ones sized to fit, each mapped when a frame does not fit in the current chunk
and unmapped when the last frame in it returns (``Python/pystate.c``,
``_PyThreadState_BumpFramePointerSlow`` and ``_PyThreadState_PopFrame``). Where the call depth
keeps crossing a chunk's end, every crossing maps a fresh chunk, page-faults it in and unmaps it.

Tracing a step is such a call: ``make_fx`` runs the traced function under a generated wrapper with
one parameter per graph input (``torch.fx.experimental.proxy_tensor.fake_signature``: two frame
slots per input, 8 KiB for a GPT of 16 layers with AdamW), and below that root tracing goes 30 to
140 frames deep and back for every op it records. Where the crossing lands depends on the model's
size and on how deep the caller already was: measured (GPT, 16 layers, fake process group of 8
ranks, 2-core CPU), the functionalizing ``make_fx`` pass of the trace took 570,066 minor page faults
and 31 s called at one depth, 8,690 and 17 s at another; under this headroom, 1 to 17,273 at the four
depths tried. The whole trace, interleaved runs at two depths, medians: 12.8 -> 11.4 s for 4 layers,
25.9 -> 21.7 s for 8, 48.5 -> 44.6 s for 16. Inductor's lowering of the 4-layer step: 86,809 and
93,393 minor page faults and 1.4 s of system time without, 1,530 and 1,642 and 0.1 s under it.

:func:`frame_stack_headroom` runs a function in a frame with ``_UNUSED_SLOTS`` unused local slots
(256 KiB). That frame does not fit in the current chunk, so CPython maps one chunk of 512 KiB for
it, and everything the function calls stacks up in the rest of that chunk (about 250 KiB, more than
1,000 frames of tracing) without mapping another: one mapping per call instead of one per crossing.
Nothing else changes; on an interpreter without chunked frame stacks the frame is only larger.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, TypeVar

__all__ = ["frame_stack_headroom"]

F = TypeVar("F", bound=Callable[..., Any])

_UNUSED_SLOTS = 32_768  # 8 bytes each: a 256 KiB frame, which CPython places in a 512 KiB chunk


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


@functools.cache
def _call_with_headroom() -> Callable[[Callable[..., Any], tuple, dict], Any]:
    """:func:`_call` with ``_UNUSED_SLOTS`` more local variables, never read or written: only its frame
    is larger. Built on first use (~13 ms), not at import. The added names go after ``_call``'s own;
    ``_call`` has no cell or free variables, whose slots would follow."""
    code = _call.__code__
    unused = tuple(f"_unused{i}" for i in range(_UNUSED_SLOTS))
    return types.FunctionType(
        code.replace(co_varnames=code.co_varnames + unused, co_nlocals=code.co_nlocals + len(unused)),
        _call.__globals__,
        "_call_with_headroom",
    )


def frame_stack_headroom(fn: F) -> F:
    """Decorate ``fn`` to run at the start of a frame-stack chunk with ~250 KiB free above it.

    Same arguments, result and exceptions as ``fn``; costs one 512 KiB mapping per call (~0.2 ms).
    See the module docstring for why and the measurements.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call_with_headroom()(fn, args, kwargs)

    return wrapper  # type: ignore[return-value]
