"""The per-parameter state of an optimizer, including the state of the optimizers it wraps.

An optimizer wrapper keeps its base optimizer as an attribute and steps it: timm's ``Lookahead``
(``self._base_optimizer``, RAdam + Lookahead as "Ranger"), the Lookahead of its paper's public
implementations (``self.optimizer``). The base optimizer's ``state`` holds its own states (SGD's
``momentum_buffer``, Adam's ``exp_avg``), often the wrapper's too (timm's ``lookahead_slow_buff``);
the wrapper may keep more in its own ``state``. A compiled step must take every one of these as a
graph input and store every one back: a state the graph did not take is created afresh on each trace
(a momentum that never accumulates), with no error.

So the state of ``optimizer`` is the union of its *holders'*: the optimizer itself and, recursively,
each ``torch.optim.Optimizer`` among its attributes whose ``state`` is another dict (a wrapper that
forwards ``state`` to its base, as accelerate's ``AcceleratedOptimizer`` does, has one holder). A key of a
wrapped holder's state is prefixed with the attribute path: ``"_base_optimizer.momentum_buffer"``.
Every reader and writer of optimizer state in spmd_expand goes through this module: per parameter
(:func:`param_state`, :func:`set_state`, :func:`items`), or per holder (:func:`holders`: the cache key,
snapshots, state creation, distribution).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

__all__ = ["holders", "param_state", "set_state", "items", "split_key"]

_SEPARATOR = "."


def holders(optimizer: torch.optim.Optimizer, every: bool = False) -> list[tuple[str, torch.optim.Optimizer]]:
    """``[(prefix, optimizer)]``: ``optimizer`` (prefix ``""``) and the optimizers it wraps, each with
    the attribute path that reaches it (``"_base_optimizer."``), outermost first; one per ``state`` dict,
    or with ``every``, also those whose ``state`` a wrapper forwards (whose ``_init_group`` creates it)."""
    found = [("", optimizer)]
    seen = {id(optimizer), id(optimizer.state)}
    for prefix, holder in found:  # grows while iterated: wrapped wrappers
        for name, value in vars(holder).items():
            if not isinstance(value, torch.optim.Optimizer) or id(value) in seen:
                continue
            if every or id(getattr(value, "state", None)) not in seen:
                seen.update((id(value), id(value.state)))
                found.append((f"{prefix}{name}{_SEPARATOR}", value))
    return found


def split_key(optimizer: torch.optim.Optimizer, key: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The holder of a (prefixed) state key and the key in its own ``state``."""
    if isinstance(key, str):
        for prefix, holder in reversed(holders(optimizer)):
            if prefix and key.startswith(prefix):
                return holder, key[len(prefix):]
    return optimizer, key


def param_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, found: Optional[list[tuple[str, torch.optim.Optimizer]]] = None
) -> dict[Any, Any]:
    """The state of ``param`` in all holders, in a new dict (keys of wrapped holders prefixed).
    ``found``: ``holders(optimizer)``, where a loop over the parameters computed it once."""
    out: dict[Any, Any] = {}
    for prefix, holder in found if found is not None else holders(optimizer):
        st = holder.state.get(param)
        if st:
            out.update(st.items() if not prefix else ((f"{prefix}{k}", v) for k, v in st.items()))
    return out


def set_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: Any, value: Any) -> None:
    """Store ``value`` as ``param``'s state ``key`` (prefixed: in the wrapped holder it names)."""
    holder, own = split_key(optimizer, key)
    holder.state[param][own] = value


def items(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[Any, Any]]]:
    """``(param, state)`` for every parameter with state in any holder (:func:`param_state`)."""
    seen: set[int] = set()
    found = holders(optimizer)
    for _, holder in found:
        for p in holder.state:
            if id(p) not in seen:
                seen.add(id(p))
                yield p, param_state(optimizer, p, found)
