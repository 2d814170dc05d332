"""``europa train -p flexshard``: europa's hooks over this package's plain API.

Each hook is a few lines: the ``[flexshard]`` table is ``europa.flexshard.config``, the
process groups come from ``europa.flexshard.process_groups`` and the planning arithmetic
from ``europa.flexshard.planner``. Imports only pluggy, europa-spec and the standard
library at module level (torch when a hook runs).

``job.state["flexshard"]`` holds the run's ``FlexShardLayout`` (its plan, local
parameters and gather units), for other plugins that want to read it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from europa.flexshard.config import NAME, FlexShardConfig
from europa.spec.hookspecs import hookimpl
from europa.spec.job import PlanningJob, RunningJob
from europa.spec.optim import muon_adamw_keywords
from europa.spec.plan_mapping import PlanMapping, SearchInputs

if TYPE_CHECKING:
    import torch

    from europa.flexshard.optimizer import FlexShardOptimizer
    from europa.flexshard.state import FlexShardState
    from europa.flexshard.whole_matrix_layout import FlexShardLayout
    from europa.spec.init import InitMatrix


@hookimpl
def europa_config_sections() -> dict[str, type]:
    return {NAME: FlexShardConfig}


@hookimpl
def europa_search_levers(
    config: Any, world_size: int, ranks_per_node: int, plan: SearchInputs
) -> list[list[dict]]:
    from europa.flexshard.planner import search_alternatives

    return [search_alternatives(config, world_size, ranks_per_node, plan)]


@hookimpl
def europa_plan(job: PlanningJob, plan: PlanMapping) -> None:
    """Replace ``plan["layout"]`` with FlexShard's whole-matrix ownership, from
    ``plan["parameter_shapes"]`` ({name: shape}) and ``plan["world_size"]``.
    With ``parallel.ep > 1`` the 3-D parameters (the routed experts) are split
    over ``ep`` and stay resident, and tokens travel by all-to-all."""
    from europa.flexshard.planner import plan_layout

    plan_layout(job, plan)


def _layout(job: RunningJob) -> FlexShardLayout:
    return job.state[NAME]


@hookimpl
def europa_shard_model(job: RunningJob, model: torch.nn.Module) -> torch.nn.Module:
    import torch

    from europa.flexshard.builder import flex_shard, stage_units
    from europa.flexshard.planner import check_budget
    from europa.flexshard.process_groups import every_group, pipeline_group, process_groups
    from europa.spec.lanes import TWINS_MADE, lanes_wanted, make_twins
    from europa.spec.replicas import LAYOUT_SUMS_REPLICAS

    table = job.config.section(NAME)
    bf16 = job.config.training.dtype == "bfloat16"
    shard, replicate, experts = process_groups(job)
    if lanes_wanted(job.config.parallel):  # paired pipeline chunks in two threads
        make_twins(every_group(shard, replicate, experts))
        job.state[TWINS_MADE] = True
    execution = getattr(job, "execution", None)
    layout = flex_shard(
        model,
        group=shard,
        replicate_group=replicate,
        units=stage_units(model) if pipeline_group(job) is not None else None,
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=getattr(torch, table.reduce_dtype) if bf16 else None,
        experts=experts,
        direct=execution.backend == "gloo" if execution is not None else None,
    )
    check_budget(job, layout)
    layout.sum_copies_in_backward(job.config.training.grad_accum_steps)
    job.state[NAME] = layout
    job.state[LAYOUT_SUMS_REPLICAS] = True  # over a fault-tolerant run's groups: in clipping
    job.claim(NAME, list(layout.slots))
    if table.log_plan and job.is_main:
        print(layout.describe(), file=sys.stderr, flush=True)
    return model


@hookimpl
def europa_init_parameters(
    job: RunningJob, model: torch.nn.Module, init_matrix: InitMatrix
) -> bool:
    _layout(job).materialise(job.device, init_matrix)
    return True


@hookimpl
def europa_build_optimizer(job: RunningJob, model: torch.nn.Module) -> FlexShardOptimizer:
    from europa.flexshard.optimizer import FlexShardOptimizer

    cfg = job.config.optimizer
    return FlexShardOptimizer(_layout(job), algorithm=cfg.name, **muon_adamw_keywords(cfg))


@hookimpl
def europa_clip_gradients(job: RunningJob, model: torch.nn.Module, max_norm: float) -> float:
    from europa.flexshard.process_groups import pipeline_group
    from europa.spec.replicas import REPLICA_GROUPS

    return _layout(job).clip_grad_norm_(
        max_norm, pipeline_group=pipeline_group(job), across=job.state.get(REPLICA_GROUPS)
    )


@hookimpl
def europa_scale_rows(
    job: RunningJob, model: torch.nn.Module, factors: dict[str, torch.Tensor]
) -> int:
    return _layout(job).scale_rows(factors)


@hookimpl
def europa_checkpoint_state(
    job: RunningJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> FlexShardState:
    from europa.flexshard.state import FlexShardState

    return FlexShardState(_layout(job), optimizer)
