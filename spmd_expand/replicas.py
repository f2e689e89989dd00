"""Check that the ranks' replicas of the model and optimizer state hold the same values.

A compiled step changes replicated values (a DDP parameter, the replicated parameters of a
tensor-parallel plan, a BatchNorm's running statistics, an optimizer's ``step``) the same way on
every rank, and the per-call checks (:func:`spmd_expand.guards.check_batch`) refuse a call whose
inputs, hyperparameters, graph or random state differ between ranks. What no call sees is code
*between* calls that changes state on some ranks only: a ``load_state_dict`` under ``if rank == 0:``,
a manual edit of a weight on one rank, an initialization that draws again on each rank after the first
call. From then on the ranks train different models, silently, as under torch DDP.
:func:`check_replicas` compares the values themselves; call it after loading a checkpoint or every few
hundred steps.
"""

from __future__ import annotations

import zlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from . import optimizer_state
from .errors import DivergenceError, SpmdError
from .guards import CallState, check_batch, mesh_group, replica_disagreement

__all__ = ["check_replicas"]

_SHOWN = 8


def _state_tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the model's parameters and buffers and the optimizer's tensor states, in a
    rank-independent order."""
    fqns = {}
    for fqn, p in model.named_parameters():
        fqns[id(p)] = fqn
        yield f"parameter {fqn}", p
    for fqn, b in model.named_buffers():
        yield f"buffer {fqn}", b
    if optimizer is None:
        return
    found = optimizer_state.holders(optimizer)
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            where = fqns.get(id(p), f"param_groups[{g}]['params'][{i}]")
            for key, value in optimizer_state.param_state(optimizer, p, found).items():
                if isinstance(value, torch.Tensor):
                    yield f"optimizer state [{where}][{key!r}]", value


def _piece(t: torch.Tensor, mesh_ids: dict) -> tuple:
    """Which piece of ``t`` this rank holds: ranks with the same piece must hold the same values. For
    a DTensor, its mesh instance (a sub-mesh is a different one on each of its groups) and this rank's
    coordinates on the mesh dims that do not replicate it; a plain tensor is one piece."""
    if not isinstance(t, DTensor):
        return ()
    mesh = t.device_mesh
    if id(mesh) not in mesh_ids:
        mesh_ids[id(mesh)] = zlib.crc32(repr(mesh.mesh.flatten().tolist()).encode())
    coordinate = mesh.get_coordinate() or []
    return (mesh_ids[id(mesh)], tuple(c for c, p in zip(coordinate, t.placements) if not isinstance(p, Replicate)))


def _checksum(t: torch.Tensor) -> int:
    if t.is_meta:  # not materialized yet (a model built on the meta device): no values to compare
        return 0
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def check_replicas(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, mesh: Optional[DeviceMesh] = None) -> int:
    """Raise :class:`DivergenceError` on every rank when ranks that hold the same piece of a parameter,
    buffer or optimizer state tensor hold different values.

    Call it on every rank, between steps (it is a collective): after loading a checkpoint, after code
    that edits the model outside the compiled step, or every few hundred steps. It changes nothing.

    Which ranks must agree follows each tensor's placements: for a ``DTensor``, the ranks of its mesh
    with the same coordinates on the mesh dims that shard it (every rank of a DDP mesh; the ranks of one
    data-parallel group for an FSDP+TP weight sharded on "tp" and replicated on "dp"); a plain tensor
    (a buffer, an optimizer's ``step`` on a plain model) is replicated over ``mesh``. Values are
    compared bit for bit, by a CRC-32 of each rank's local tensor.

    Args:
        model: the parallelized model (after the first call of its ``spmd.compile`` step, or
            ``spmd.parallelize``), or a plain model replicated on every rank of ``mesh`` (e.g. one
            wrapped in torch's ``DistributedDataParallel``).
        optimizer: its optimizer, whose tensor states are checked too; None to check the model only.
        mesh: the mesh that replicates plain tensors; default the mesh of the model's first DTensor
            parameter, else every rank of the default process group.

    Returns:
        The number of tensors compared.

    Cost: one pass over every local tensor (CRC-32 on the host: tensors on an accelerator are copied
    to host memory; ~0.25 s per GB on one CPU core here) and one ``all_gather_object`` of one integer
    per tensor over the mesh's ranks.

    Raises:
        SpmdError: no default process group (``torch.distributed.init_process_group``).
        DivergenceError: on every rank at once, naming up to 8 tensors whose replicas differ and the
            ranks on each side, or the tensors that exist on some ranks only.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SpmdError("spmd.check_replicas compares values across ranks: call torch.distributed.init_process_group first")
    tensors = list(_state_tensors(model, optimizer))
    if dist.get_backend() == "fake":
        return len(tensors)
    if mesh is None:
        mesh = next((t.device_mesh for _, t in tensors if isinstance(t, DTensor)), None)
    if mesh is not None:
        # The per-call exchange first: a peer still in a step (one more batch on some ranks) meets it there
        # and every rank learns which call each rank makes, instead of mismatched collectives.
        check_batch((), None, mesh, CallState(step="spmd.check_replicas"))
    mesh_ids: dict[int, int] = {}
    report = [(name, _piece(t, mesh_ids), _checksum(t.to_local() if isinstance(t, DTensor) else t)) for name, t in tensors]
    group = mesh_group(mesh) if mesh is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    reports: list = [None] * len(ranks)
    names = [name for name, _, _ in report]
    dist.all_gather_object(reports, (zlib.crc32(repr(names).encode()), [(p, c) for _, p, c in report]), group=group)
    if any(r[0] != reports[0][0] for r in reports):
        everyone: list = [None] * len(ranks)
        dist.all_gather_object(everyone, names, group=group)
        common = set(everyone[0]).intersection(*everyone[1:])
        lines = [
            f"  rank {rank}: {', '.join(n for n in own if n not in common)[:300] or '(none of its own)'}"
            for rank, own in zip(ranks, everyone)
        ]
        raise DivergenceError(
            "the ranks' models and optimizers do not have the same tensors (each rank's tensors that others lack):\n"
            + "\n".join(lines)
            + "\n  fix: build the model and optimizer the same way on every rank, and create optimizer state on every "
            "rank (a step on every rank, or the same checkpoint loaded everywhere)"
        )
    differing = []
    for k, (name, t) in enumerate(tensors):
        sides = replica_disagreement(ranks, [entries[k] for _, entries in reports])
        if sides is not None:
            placements = tuple(t.placements) if isinstance(t, DTensor) else "a plain tensor, replicated"
            differing.append(f"  {name} {tuple(t.shape)} ({placements}): values differ between {sides}")
    if differing:
        more = f"\n  ... and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else ""
        raise DivergenceError(
            f"the ranks' replicas of {len(differing)} of {len(tensors)} tensors hold different values (ranks that hold "
            f"the same piece must hold the same values):\n" + "\n".join(differing[:_SHOWN]) + more + "\n"
            "  a compiled step changes replicated values the same way on every rank; they differ after code outside "
            "the step changed them on some ranks only (`load_state_dict` or a weight edit under `if rank == 0:`, "
            "an initialization drawn again on each rank)\n"
            "  fix: make that change on every rank: load checkpoints on every rank (torch.distributed.checkpoint, or "
            "set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, "
            "broadcast_from_rank0=True)))"
        )
    return len(tensors)
