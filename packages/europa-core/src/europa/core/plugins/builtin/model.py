"""Default ``europa_build_model``: the EUROPA MoE from ``[model]``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from europa.spec.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from europa.spec.job import PlanningJob


def runs_on_cpu(job: PlanningJob) -> bool:
    """The run's compute device: the job's once known, else what ``[parallel]`` asks for."""
    device = getattr(job, "device", None)  # a RunningJob's; a PlanningJob has none
    if device is not None:
        return device.type == "cpu"
    import torch

    wanted = job.config.parallel.device
    return wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available())


@hookimpl(trylast=True)
def europa_build_model(job: PlanningJob) -> torch.nn.Module:
    from europa.core.launch.distributed import routed_model
    from europa.core.model import build_moe_model

    fp32 = job.config.training.dtype == "float32"
    attention = "block_causal" if runs_on_cpu(job) else "sdpa"
    model = routed_model(job.config, job.world_size, job.node_size)
    return build_moe_model(model, native_dtype_experts=fp32, attention=attention)
