"""``make_plan``: will this config fit, and how fast will it go?

The model is built on the meta device, exactly as ``europa train`` builds it
(through ``europa_build_model``); core's FSDP2 layout is the default and every
enabled plugin may change the plan through ``europa_plan`` (a sharding plugin
replaces ``plan["layout"]``, europa-offload fills ``plan["host_offload"]``,
europa-overlap ``plan["overlapped_kinds"]``). ``europa train``'s pre-flight
check calls the same function, so the two never disagree. With pipeline stages each
pipeline rank is planned over its own layers (``europa.core.plan.pipeline_plan``).
"""

from __future__ import annotations

from pathlib import Path

from europa.core.config.schema import EuropaConfig
from europa.core.job import Job
from europa.core.launch.distributed import check_node_layout, mesh_shape
from europa.core.plan.assemble import assemble, plugin_plan
from europa.core.plan.hardware import HardwareProfile
from europa.core.plan.pipeline_plan import plan_pipeline
from europa.core.plan.record import Plan
from europa.core.plan.shapes import ModelShapes

__all__ = ["Plan", "make_plan"]


def make_plan(
    config: EuropaConfig,
    plugins,
    hardware: HardwareProfile,
    world_size: int,
    model=None,
    ranks_per_node: int = 0,
    shapes: ModelShapes | None = None,
) -> Plan:
    """``ranks_per_node``: the nodes the ranks form (default: ``parallel.ranks_per_node``,
    else the profile's ``gpus_per_node``). ``shapes``: the model's, read once by a caller
    that plans many layouts of one model (reading them walks the whole module tree)."""
    mesh = mesh_shape(config.parallel, world_size)[1:]
    job = Job(
        config=config,
        run_dir=Path("."),
        world_size=world_size,
        ranks_per_node=ranks_per_node or hardware.gpus_per_node,
    )
    check_node_layout(config.parallel, world_size, job.node_size)
    if shapes is None:
        if model is None:
            model = plugins.hook.europa_build_model(job=job)
        shapes = ModelShapes.of(model)
    if config.parallel.pp > 1:
        return plan_pipeline(config, plugins, hardware, world_size, shapes, job.node_size)
    plan = plugin_plan(job, plugins, shapes, hardware=hardware)
    return assemble(config, hardware, world_size, mesh, shapes, plan, job.node_size)
