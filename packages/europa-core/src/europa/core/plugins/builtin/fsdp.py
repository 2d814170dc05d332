"""Core's default layout: FSDP2 over the data-parallel axes (plain or DDP in fp32 unsharded).

``europa_shard_model``: each transformer block is one FSDP unit (its
parameters are gathered together just before it runs and freed after), the
embedding/norm/head form the root unit. With ``dp_replicate > 1`` the mesh is
2-D and FSDP2 becomes HSDP. Works on gloo: gradients use FSDP's default
averaging (a custom divide factor would need PREMUL_SUM, which gloo lacks).

``training.dtype = "bfloat16"`` is FSDP2 mixed precision: fp32 master weights
and optimizer state, bf16 gathered parameters and compute, fp32 gradient
reduction.

In fp32 with ``dp_shard = 1`` nothing is sharded, so FSDP2 is not used: it
would still copy every gradient into a flat reduce buffer and back, and every
gathered block out of its all-gather buffer (about 9% of a ``debug`` step on
CPU). One rank keeps the model plain; ``dp_replicate > 1`` ranks replicate it
with torch's composable ``replicate`` (DDP: gradients averaged in buckets while
backward runs, parameter names unchanged). DDP builds itself at the first
forward, after the parameters are materialised. Every hook below handles plain
parameters, and checkpoints stay interchangeable between layouts because
torch.distributed.checkpoint reshards plain tensors and DTensors alike.

The hooks that depend on where parameters live (init, clipping, checkpoint
state) have their defaults here too; they handle plain tensors (one process)
and DTensors, so a third-party DTensor layout needs none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from europa.core.errors import PluginError
from europa.spec.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.stateful import Stateful

    from europa.spec.init import InitMatrix
    from europa.spec.job import RunningJob

OWNER = "core.fsdp2"


def data_parallel_mesh(job: RunningJob):
    if job.config.parallel.dp_replicate > 1:
        return job.mesh["dp_replicate", "dp_shard"]
    return job.mesh["dp_shard"]


def mixed_precision(dtype: str):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@hookimpl(trylast=True)
def europa_shard_model(job: RunningJob, model: torch.nn.Module) -> torch.nn.Module:
    ep = job.config.parallel.ep
    if ep > 1:
        raise PluginError(
            f"parallel.ep = {ep}: core's FSDP2 layout has no expert parallelism; expected 1, "
            "or enable a plugin whose europa_shard_model provides it"
        )
    from torch.distributed.fsdp import fully_shard

    from europa.core.plan.builtin_layouts import (
        data_parallel_form,  # loads the model: not at startup
    )

    dtype = job.config.training.dtype
    job.claim(OWNER, (name for name, _ in model.named_parameters()))
    replicas = job.mesh["dp_replicate"]
    form = data_parallel_form(replicas.size(), job.mesh["dp_shard"].size(), dtype)
    staged = job.mesh["pp"].size() > 1
    if staged and form == "ddp":  # DDP hooks the module's forward, which stages never run
        form = "hsdp"
    if form == "ddp":
        from torch.distributed._composable.replicate import replicate

        replicate(model, process_group=replicas.get_group(), gradient_as_bucket_view=True)
    if form in ("plain", "ddp"):
        return model
    mesh = data_parallel_mesh(job)
    policy = mixed_precision(dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    if staged:
        # Pipeline stages run views of this module (europa.core.pipeline.runner), never its
        # own forward, so the root's hooks would not run: each part is a unit of its own.
        for name in ("tok_embeddings", "norm", "lm_head"):
            part = getattr(model, name, None)
            if part is not None:
                fully_shard(part, mesh=mesh, mp_policy=policy)
        return model
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@hookimpl(trylast=True)
def europa_init_parameters(
    job: RunningJob, model: torch.nn.Module, init_matrix: InitMatrix
) -> bool:
    from europa.core.model.materialise import init_parameters

    init_parameters(model, job.device, init_matrix)
    return True


@hookimpl(trylast=True)
def europa_clip_gradients(job: RunningJob, model: torch.nn.Module, max_norm: float) -> float:
    from europa.core.train.gradients import clip_gradients

    pipeline = job.mesh["pp"]
    return clip_gradients(model, max_norm, pipeline.get_group() if pipeline.size() > 1 else None)


@hookimpl(trylast=True)
def europa_scale_rows(
    job: RunningJob, model: torch.nn.Module, factors: dict[str, torch.Tensor]
) -> int:
    from europa.spec.qk_clip_step import scale_held_rows

    return scale_held_rows(model, factors)


@hookimpl(trylast=True)
def europa_checkpoint_state(
    job: RunningJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Stateful:
    from europa.core.checkpoint.store import TorchDistributedState

    return TorchDistributedState(model, optimizer)
