"""Shared fixtures: one in-process fake process group (world size 4) for tracing-only tests.

The fake backend runs no real communication (collectives return garbage), so tests using it only
inspect graphs and placements, never numbers. Only one default group can exist per process, hence a
session-scoped fixture; it is created only when a test asks for it (spawned multi-rank tests do not).

Multi-rank tests start their ranks from a fork server that has imported spmd_expand once
(``run_local``'s "forkserver" method): about 3 s less per run than a fresh interpreter per rank.
``SPMD_START_METHOD=spawn make test`` runs them the other way.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from spmd_expand.app.launch import START_METHOD_ENV

FAKE_WORLD_SIZE = 4

os.environ.setdefault(START_METHOD_ENV, "forkserver")  # read by spmd_expand.app.launch.run_local


@pytest.fixture(scope="session")
def fake_mesh():
    """A 1-D CPU ``DeviceMesh`` of size 4 over a fake process group (this process is rank 0)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", rank=0, world_size=FAKE_WORLD_SIZE, store=FakeStore())
    else:
        assert dist.get_world_size() == FAKE_WORLD_SIZE, "another default process group already exists"
    yield init_device_mesh("cpu", (FAKE_WORLD_SIZE,))
    if owned:
        dist.destroy_process_group()
