"""``europa train -p flexshard``: europa's hooks over this package's plain API.

Imports only pluggy and the standard library at module level (torch when a
hook runs); ``job`` is used by duck typing: ``job.config`` (its ``parallel``,
``training``, ``optimizer`` and ``flexshard`` tables), ``job.mesh`` (axes
``dp_replicate``, ``dp_shard``, ``ep``), ``job.device``, ``job.claim``,
``job.state`` and ``job.is_main``.

``job.state["flexshard"]`` holds the run's ``FlexShardLayout`` (its plan,
local parameters and gather units), for other plugins that want to read it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pluggy

from europa.flexshard.errors import FlexShardError

hookimpl = pluggy.HookimplMarker("europa")

NAME = "flexshard"
GIB = 2**30
# fp32 tensors a rank keeps per owned parameter element: the parameter and its
# gradient, plus the optimizer's state (Muon: momentum; AdamW: two moments).
_COPIES = {"muon": 3, "adamw": 4}


@dataclass(kw_only=True)
class FlexShardConfig:
    reduce_dtype: str = field(
        default="float32",
        metadata={
            "choices": ("float32", "bfloat16"),
            "doc": "dtype of the gradient reduce-scatter in bfloat16 runs",
        },
    )
    log_plan: bool = field(
        default=True, metadata={"doc": "print the ownership summary (bytes per rank) at start"}
    )
    max_rank_gib: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "doc": "refuse a layout whose most loaded rank holds more parameter, gradient and "
            "optimizer-state GiB than this; 0: no limit",
        },
    )


@hookimpl
def europa_config_sections():
    return {NAME: FlexShardConfig}


def _layout(job):
    return job.state[NAME]


def _check_budget(job, plan) -> None:
    limit = job.config.section(NAME).max_rank_gib
    if not limit:
        return
    copies = _COPIES[job.config.optimizer.name]
    need = max(plan.rank_bytes()) * copies
    if need > limit * GIB:
        raise FlexShardError(
            f"flexshard.max_rank_gib = {limit}: the most loaded of {plan.group_size} rank(s) "
            f"would hold {need / GIB:.2f} GiB of parameters, gradients and optimizer state; "
            "expected more ranks or a larger limit"
        )


@hookimpl
def europa_shard_model(job, model):
    import torch

    from europa.flexshard.layout import flex_shard

    parallel = job.config.parallel
    if parallel.ep > 1:
        raise FlexShardError(
            f"parallel.ep = {parallel.ep}: europa-flexshard lays out data parallelism only "
            "in this version; expected 1"
        )
    table = job.config.section(NAME)
    bf16 = job.config.training.dtype == "bfloat16"
    replicate = job.mesh["dp_replicate"].get_group() if parallel.dp_replicate > 1 else None
    layout = flex_shard(
        model,
        group=job.mesh["dp_shard"].get_group(),
        replicate_group=replicate,
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=getattr(torch, table.reduce_dtype) if bf16 else None,
    )
    _check_budget(job, layout.plan)
    job.state[NAME] = layout
    job.claim(NAME, list(layout.slots))
    if table.log_plan and job.is_main:
        print(layout.plan.describe(), file=sys.stderr, flush=True)
    return model


@hookimpl
def europa_init_parameters(job, model, init_matrix):
    _layout(job).materialise(job.device, init_matrix)
    return True


@hookimpl
def europa_build_optimizer(job, model):
    from europa.flexshard.optimizer import FlexShardOptimizer

    cfg = job.config.optimizer
    return FlexShardOptimizer(
        _layout(job),
        lr=cfg.lr,
        algorithm=cfg.name,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )


@hookimpl
def europa_clip_gradients(job, model, max_norm):
    return _layout(job).clip_grad_norm_(max_norm)


@hookimpl
def europa_checkpoint_state(job, model, optimizer):
    from europa.flexshard.state import FlexShardState

    return FlexShardState(_layout(job), optimizer)


def unit_of(name: str) -> str:
    """The gather unit ``flex_shard`` gives a parameter of a model with ``layers``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else "<root>"


@hookimpl
def europa_plan(job, plan):
    """Reads ``plan["parameter_shapes"]`` ({name: shape}) and ``plan["world_size"]``;
    adds ``plan["flexshard"]``: the ownership summary (bytes per rank, max / mean)
    and the bytes communicated inside ``optimizer.step()`` (none)."""
    from europa.flexshard.layout import orthogonalised_by_default
    from europa.flexshard.plan import ParameterSpec, plan_ownership

    parallel = job.config.parallel
    shard_ranks = plan["world_size"] // (parallel.dp_replicate * parallel.ep)
    itemsize = plan.get("parameter_itemsize", 4)
    specs = [
        ParameterSpec(
            name,
            tuple(shape),
            itemsize,
            unit_of(name),
            orthogonalised=orthogonalised_by_default(name, tuple(shape)),
        )
        for name, shape in plan["parameter_shapes"].items()
    ]
    ownership = plan_ownership(specs, shard_ranks)
    plan[NAME] = ownership.summary() | {
        "optimizer_step_bytes_communicated": 0,
        "state_bytes_per_rank_max": max(ownership.rank_bytes(), default=0)
        * _COPIES[job.config.optimizer.name],
    }
