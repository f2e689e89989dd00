"""frame_stack_headroom: transparent to the decorated function, and deep call patterns under it map
no frame-stack chunks (minor page faults counted with ``getrusage``)."""

from __future__ import annotations

import resource
import sys

import pytest

from spmd_expand.frame_stack import _UNUSED_SLOTS, frame_stack_headroom


def _dive(depth: int) -> int:
    # A few locals per frame, as tracing's frames have: ~150 frames span more than one 16 KiB chunk.
    a, b, c, d = depth, depth + 1, depth + 2, depth + 3
    return a + b + c + d if depth == 0 else _dive(depth - 1)


def _oscillate(times: int = 400, depth: int = 150) -> int:
    """Minor page faults while the call depth goes ``times`` times from here to ``depth`` frames deeper."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        _dive(depth)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_passes_arguments_results_and_exceptions_through():
    @frame_stack_headroom
    def f(a, b=2, *, c):
        """doc"""
        if c is None:
            raise KeyError("c")
        return a, b, c, sys._getframe(1).f_code.co_nlocals

    a, b, c, caller_locals = f(1, c=3)
    assert (a, b, c) == (1, 2, 3)
    assert caller_locals >= _UNUSED_SLOTS  # the caller is the frame that holds the headroom
    assert f.__doc__ == "doc" and f.__wrapped__(1, c=3)[:3] == (1, 2, 3)
    with pytest.raises(KeyError):
        f(1, c=None)


def test_deep_calls_under_it_map_no_chunks():
    _oscillate(times=2)  # warm up: code objects, caches
    without = _oscillate()
    under = frame_stack_headroom(_oscillate)()
    # Without the headroom the depth crosses a chunk's end on every dive (150 frames > 16 KiB): one
    # mapping and its page faults each time on CPython >= 3.11; with it, everything fits in one chunk.
    assert under < 40, f"{under} minor page faults with the headroom, {without} without"
