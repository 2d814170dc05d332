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


def _check_budget(job, layout) -> None:
    limit = job.config.section(NAME).max_rank_gib
    if not limit:
        return
    need = layout.max_local_bytes() * _COPIES[job.config.optimizer.name]
    if need > limit * GIB:
        raise FlexShardError(
            f"flexshard.max_rank_gib = {limit}: the most loaded of {job.world_size} rank(s) "
            f"would hold {need / GIB:.2f} GiB of parameters, gradients and optimizer state; "
            "expected more ranks or a larger limit"
        )


def _groups(job):
    """(shard group, replicate group, expert parallelism) for ``job.mesh``.

    Without ``ep`` the owned layout spans ``dp_shard``. With ``ep > 1`` it spans
    ``dp_shard × ep`` (every rank reads its own data), the experts split over
    ``ep``, and their copies sit along ``dp_replicate × dp_shard``."""
    import torch.distributed as dist

    from europa.flexshard.experts import ExpertParallel

    mesh, parallel = job.mesh, job.config.parallel
    replicate = mesh["dp_replicate"].get_group() if parallel.dp_replicate > 1 else None
    if parallel.ep == 1:
        return mesh["dp_shard"].get_group(), replicate, None
    ranks = mesh.mesh  # [dp_replicate, dp_shard, ep] -> global rank
    shard, _ = dist.new_subgroups_by_enumeration([r.flatten().tolist() for r in ranks])
    copies = None
    if ranks.shape[0] * ranks.shape[1] > 1:
        per_ep = [ranks[:, :, e].flatten().tolist() for e in range(ranks.shape[2])]
        copies, _ = dist.new_subgroups_by_enumeration(per_ep)
    experts = ExpertParallel(group=mesh["ep"].get_group(), copies=copies)
    return shard, replicate, experts


@hookimpl
def europa_shard_model(job, model):
    import torch

    from europa.flexshard.layout import flex_shard

    table = job.config.section(NAME)
    bf16 = job.config.training.dtype == "bfloat16"
    shard, replicate, experts = _groups(job)
    layout = flex_shard(
        model,
        group=shard,
        replicate_group=replicate,
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=getattr(torch, table.reduce_dtype) if bf16 else None,
        experts=experts,
    )
    _check_budget(job, layout)
    job.state[NAME] = layout
    job.claim(NAME, list(layout.slots))
    if table.log_plan and job.is_main:
        print(layout.describe(), file=sys.stderr, flush=True)
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
    adds ``plan["flexshard"]``: the ownership summary (bytes per rank, max / mean),
    the bytes communicated inside ``optimizer.step()`` (none), and with
    ``parallel.ep > 1`` the resident routed-expert bytes per rank and the expert
    all-to-all payload per rank and step. 3-D parameters are the routed experts.
    Also sets ``plan["layout_bytes_per_rank"]``: the parameter bytes each global
    rank holds (what ``europa import-hf`` reports each rank would read)."""
    from europa.flexshard.experts import all_to_all_bytes_per_rank, expert_stack
    from europa.flexshard.layout import orthogonalised_by_default
    from europa.flexshard.plan import ParameterSpec, plan_ownership

    cfg = job.config
    parallel, model, training = cfg.parallel, cfg.model, cfg.training
    ep = parallel.ep
    shard_ranks = plan["world_size"] // parallel.dp_replicate  # dp_shard × ep
    itemsize = plan.get("parameter_itemsize", 4)
    shapes = {name: tuple(shape) for name, shape in plan["parameter_shapes"].items()}
    routed = {name for name, shape in shapes.items() if ep > 1 and len(shape) == 3}
    specs = [
        ParameterSpec(name, shape, itemsize, unit_of(name), orthogonalised_by_default(name, shape))
        for name, shape in shapes.items()
        if name not in routed
    ]
    ownership = plan_ownership(specs, shard_ranks)
    copies = _COPIES[cfg.optimizer.name]
    summary = ownership.summary() | {"optimizer_step_bytes_communicated": 0}
    expert_bytes = 0
    if routed:
        stacks: dict[str, list[tuple[int, ...]]] = {}  # in model order, as at run time
        for name, shape in shapes.items():
            if name in routed:
                # torchtitan's stacks live in <module>.inner_experts; plan per <module>
                module = name.rpartition(".")[0].removesuffix(".inner_experts")
                stacks.setdefault(module, []).append(shape)
        experts = plan_ownership(
            [expert_stack(module, s, itemsize) for module, s in stacks.items()], ep
        )
        expert_bytes = max(experts.rank_bytes())
        recompute = cfg.section("activation_checkpointing").mode == "full"
        activation_bytes = 2 if training.dtype == "bfloat16" else 4
        per_micro = all_to_all_bytes_per_rank(
            tokens=training.batch_size * training.seq_len,
            top_k=model.top_k,
            dim=model.dim,
            itemsize=activation_bytes,
            num_experts=model.num_experts,
            moe_layers=len(stacks),
            forward_passes=2 if recompute else 1,
        )
        summary |= {
            "routed_expert_bytes_per_rank": experts.rank_bytes(),
            "expert_all_to_all_bytes_per_rank_per_step": per_micro * training.grad_accum_steps,
        }
    summary["state_bytes_per_rank_max"] = (summary["bytes_max"] + expert_bytes) * copies
    plan[NAME] = summary
    # Global rank r is shard rank r % (dp_shard × ep) and expert rank r % ep.
    routed_bytes = summary.get("routed_expert_bytes_per_rank")
    plan["layout_bytes_per_rank"] = [
        summary["bytes_per_rank"][r % shard_ranks] + (routed_bytes[r % ep] if routed_bytes else 0)
        for r in range(plan["world_size"])
    ]
