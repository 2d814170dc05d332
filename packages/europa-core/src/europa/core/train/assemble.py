"""A rank's model and optimizer, assembled through the hooks in their phase order
(``europa.spec.hookspecs.PHASES``): the trainer's, and the same for a rank's program
executed on fake tensors (``europa.core.execute``)."""

from __future__ import annotations

from typing import Any

import torch

from europa.core.job import Job
from europa.core.model.materialise import init_buffers
from europa.spec.init import InitMatrix


def place_model(job: Job, plugins, model: torch.nn.Module, init_matrix: InitMatrix):
    """shard → wrap → materialise (the parameters from ``init_matrix``, then the buffers)."""
    hook = plugins.hook
    model = hook.europa_shard_model(job=job, model=model)
    hook.europa_wrap_model(job=job, model=model)
    hook.europa_init_parameters(job=job, model=model, init_matrix=init_matrix)
    init_buffers(model, job.device)
    return model


def build_optimizer(job: Job, plugins, model: torch.nn.Module) -> tuple[Any, Any]:
    """The optimizer phase: (the optimizer as built, its checkpoint state); the one a
    step calls, wrapped by any plugin, is ``job.optimizer``."""
    hook = plugins.hook
    built = hook.europa_build_optimizer(job=job, model=model)
    state = hook.europa_checkpoint_state(job=job, model=model, optimizer=built)
    job.optimizer = built
    hook.europa_wrap_optimizer(job=job)
    return built, state
