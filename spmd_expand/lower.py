"""Lower the expanded per-rank graph to something runnable: Inductor code, or the fx graph as is."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx

from .errors import SpmdError

__all__ = ["LOWERINGS", "lower"]

LOWERINGS = ("inductor", "eager")


def lower(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], mode: str) -> Callable[..., list]:
    """Compile ``gm`` for ``example_inputs`` (this rank's local tensors).

    ``"inductor"`` runs ``torch._inductor.compile_fx.compile_fx`` (C++/OpenMP on CPU, Triton on CUDA);
    functional collectives in the graph are lowered by Inductor and run on the default process group.
    ``"eager"`` returns ``gm`` itself. Both mutate parameter/state inputs in place (their ``copy_``).

    Raises:
        SpmdError: an unknown ``mode``.
    """
    if mode == "eager":
        return gm
    if mode == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))
    raise SpmdError(f"lower={mode!r} is not one of {LOWERINGS}")
