"""Lower the expanded per-rank graph to something runnable: Inductor code, or the fx graph as is."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from .errors import SpmdError
from .rng import draws_random
from .watch import watch_collectives

__all__ = ["LOWERINGS", "lower"]

LOWERINGS = ("inductor", "eager")


_OUR_COMM_PASSES = frozenset({"bucketing", "overlap"})


def lower(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    mode: str,
    ran_passes: frozenset = frozenset(),
    mesh: Optional[DeviceMesh] = None,
) -> Callable[..., list]:
    """Compile ``gm`` for ``example_inputs`` (this rank's local tensors).

    ``"inductor"`` runs ``torch._inductor.compile_fx.compile_fx`` (C++/OpenMP on CPU, Triton on CUDA);
    functional collectives in the graph are lowered by Inductor and run on the default process group.
    ``"eager"`` returns ``gm`` itself. Both mutate parameter/state inputs in place (their ``copy_``).

    Inductor normally replaces random ops by its own generator (Philox-style seeds it draws once per
    call), whose values differ from ATen's; the single-device promise needs ATen's draws, so a graph
    that draws random numbers is compiled with ``torch._inductor.config.fallback_random`` set for this
    compilation only. Inductor then calls the ATen ops and keeps them in program order.

    When our ``bucketing`` or ``overlap`` pass ran (``ran_passes`` names the passes that ran),
    Inductor's own collective bucketing and compute/communication reordering stay off (they are off
    by default in torch 2.13; set explicitly so a user's global Inductor config cannot make them run
    twice), and so does its peak-memory reordering, which would move the collectives back.

    Either way the result is wrapped by :func:`~spmd_expand.watch.watch_collectives`: a collective that
    fails or times out raises :class:`~spmd_expand.errors.CollectiveError` naming its node (and its
    mesh dim of ``mesh``).

    Raises:
        SpmdError: an unknown ``mode``.
    """
    return watch_collectives(gm, _lower(gm, example_inputs, mode, ran_passes), mesh)


def _cacheable():
    """A tracing context whose fake mode has a ``ShapeEnv``: Inductor's FX graph cache (on by default)
    bypasses a graph compiled without one ("No shape env"), so each process compiled every graph again.
    ``static_shapes``: our graphs are specialized to this rank's local sizes."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)))


def _lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], mode: str, ran_passes) -> Callable[..., list]:
    if mode == "eager":
        return gm
    if mode == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        patches: dict = {}
        if any(draws_random(n) for n in gm.graph.nodes):
            patches["fallback_random"] = True
        if _OUR_COMM_PASSES & set(ran_passes):
            patches.update(
                {
                    "reorder_for_compute_comm_overlap": False,
                    "reorder_for_peak_memory": False,
                    "bucket_all_gathers_fx": "none",
                    "bucket_reduce_scatters_fx": "none",
                    "bucket_all_reduces_fx": "none",
                    "aten_distributed_optimizations.enable_overlap_scheduling": False,
                }
            )
        with inductor_config.patch(patches) if patches else contextlib.nullcontext(), _cacheable():
            return compile_fx(gm, list(example_inputs))
    raise SpmdError(f"lower={mode!r} is not one of {LOWERINGS}")
