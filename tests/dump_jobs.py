"""Jobs for ``spmd-expand dump --job`` in the tool tests: the built-in MLP job and a variant of it."""

from __future__ import annotations

import torch.nn.functional as F
from spmd_expand.tools.dump import Job, mlp_job


def scaled_input_step(model, optimizer, x, y):
    """The MLP step with the input scaled by 2 first: one extra node (``mul``) in every graph."""
    loss = F.cross_entropy(model(x * 2.0), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def scaled_input_mlp_job() -> Job:
    job = mlp_job()
    return Job(job.model, job.optimizer, job.batch, scaled_input_step)
