"""One plan assembled: the plugins' ``plan`` mapping, and from it a rank's memory,
traffic and step (``assemble``), for the whole model or one pipeline rank's layers
(``StageScope``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from europa.core.errors import PluginError
from europa.core.job import Job
from europa.core.launch.distributed import mesh_shape
from europa.core.plan.activations import block_activations
from europa.core.plan.attention_gradients import attention_gradient_bytes
from europa.core.plan.builtin_layouts import FSDP2, data_parallel_form, fsdp2_layout
from europa.core.plan.checkpoint_cost import write_seconds
from europa.core.plan.context import (
    exchange_bytes_per_pass,
    query_projection_flops,
    rows_per_micro_batch,
    upprojection_flops,
)
from europa.core.plan.goodput import heal_seconds, read_seconds
from europa.core.plan.hardware import DEVICE_TO_HOST, HardwareProfile
from europa.core.plan.memory import (
    Activations,
    MemoryModel,
    RankState,
    activations,
    kept_blocks,
    unique_state_bytes,
)
from europa.core.plan.moments import peak
from europa.core.plan.record import STAGING, Plan
from europa.core.plan.shapes import ModelShapes
from europa.core.plan.timing import (
    LAYOUT_OVERLAPPED,
    clip_maxima,
    logit_max_flops,
    logit_max_scores_bytes,
    model_flops_per_token,
    query_windows,
    rank_compute,
    transfers,
)
from europa.core.plan.traffic import step_traffic, strided_link
from europa.plan.exposure import StepTime, step_time
from europa.spec.offload import HostOffload
from europa.spec.optim import FP32
from europa.spec.plan_layout import Layout
from europa.spec.plan_mapping import PlanMapping

MODES = ("none", "full")  # activation_checkpointing.mode
_CORE_KEYS = {
    "world_size",
    "parameter_shapes",
    "parameter_itemsize",
    "hardware",
    "layout",
    "host_offload",
    "overlapped_kinds",
}


def plugin_plan(
    job: Job,
    plugins,
    shapes: ModelShapes,
    *,
    itemsize: int = 4,
    hardware: HardwareProfile | None = None,
) -> PlanMapping:
    """The ``plan`` mapping after every enabled plugin's ``europa_plan``: core's
    FSDP2 layout unless a layout plugin replaced it."""
    _, replicate, shard, ep = mesh_shape(job.config.parallel, job.world_size)
    form = data_parallel_form(replicate, shard, job.config.training.dtype)
    plan: PlanMapping = {
        "world_size": job.world_size,
        "parameter_shapes": shapes.as_dict(),
        "parameter_itemsize": itemsize,
        "layout": fsdp2_layout(shapes, shard, job.config.optimizer.name, form=form),
    }
    if hardware is not None:
        plan["hardware"] = hardware.as_dict()
    plugins.hook.europa_plan(job=job, plan=plan)
    Layout.parse(plan["layout"])  # the contract, checked once: one line if broken
    if plan["layout"]["owner"] == FSDP2 and ep > 1:
        raise PluginError(
            f"parallel.ep = {ep}: core's FSDP2 layout has no expert parallelism; expected 1, "
            "or enable a plugin whose europa_shard_model provides it"
        )
    return plan


@dataclass(frozen=True)
class StageScope:
    """What one pipeline rank holds of the model, to plan its layers as a model of their
    own (``europa.core.plan.pipeline_plan``)."""

    blocks: frozenset[str]  # its blocks ("layers.3"), and "<root>" with the embedding or head
    layers: int  # how many of the model's layers
    head: bool  # it holds the output head
    # Saved activations of the micro-batches it holds at once, on the device and the host
    # (None: one micro-batch's, as without stages).
    held_device: int | None = None
    held_host: int | None = None
    run_world_size: int = 0  # the whole run's ranks (QK-clip's maxima are reduced over all)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        return tuple(sorted(int(b.split(".")[1]) for b in self.blocks if b.startswith("layers.")))


def stage_activations(config, hardware, plan: PlanMapping, names) -> dict[str, Activations]:
    """One micro-batch's saved activations of the blocks ``names``, by activation
    checkpointing mode (``MODES``), under the plan's offload."""
    training, model_cfg = config.training, config.model
    compute_bytes = 2 if training.dtype == "bfloat16" else 4
    offload = HostOffload.parse(plan.get("host_offload"))
    blocks = block_activations(
        model_cfg,
        seq_len=training.seq_len,
        batch=training.batch_size,
        dtype_bytes=compute_bytes,
        kernel=hardware.attention_kernel,
        cp=config.parallel.cp,
        exchange=config.parallel.cp_exchange,
        expert_output_bytes=plan["layout"].get("expert_output_bytes", FP32),
    )
    blocks = [b for b in blocks if b.name in names]
    kept_bytes = plan["layout"].get("expert_kept_bytes_per_moe_block", 0)
    kept = {f"layers.{i}": kept_bytes for i in range(model_cfg.n_dense_layers, model_cfg.n_layers)}
    tokens = rows_per_micro_batch(config)
    return {mode: activations(blocks, tokens, mode == "full", offload, kept) for mode in MODES}


def _every_block(config) -> frozenset[str]:
    return frozenset([*(f"layers.{i}" for i in range(config.model.n_layers)), "<root>"])


def assemble(
    config, hardware, world_size, mesh, shapes, plan, per_node, scope: StageScope | None = None
) -> Plan:
    training, model_cfg = config.training, config.model
    layout = plan["layout"]
    compute_bytes = 2 if training.dtype == "bfloat16" else 4
    reduce_bytes = layout.get("reduce_itemsize", 4)
    recompute = config.section("activation_checkpointing").mode == "full"
    offload = HostOffload.parse(plan.get("host_offload"))
    tokens = rows_per_micro_batch(config)  # a rank's rows of its micro-batch's sequences
    names = scope.blocks if scope is not None else _every_block(config)
    by_mode = stage_activations(config, hardware, plan, names)
    acts = by_mode["full" if recompute else "none"]
    host_per_micro_batch = acts.host  # what goes out and back each micro-batch
    if scope is not None and scope.held_device is not None:
        acts = replace(acts, device=scope.held_device + acts.recompute, host=scope.held_host)
    state = RankState.of(layout)
    rank = state.most_loaded()
    optimizer_state = state.optimizer_state[rank]
    optimizer_on_host = optimizer_state if offload.optimizer_state else 0
    stage = state.parameters[rank] + optimizer_state  # an async save's copy, fp32 as held
    staging = {STAGING: stage if config.checkpoint.mode == "async" else 0}
    # A CPU rank's "host" buffers are the RAM its device memory already names.
    device_staging, host_staging = (staging, {}) if hardware.device == "cpu" else ({}, staging)
    units = layout["gathered_unit_elements"]
    kept_gathered = kept_blocks(units, plan.get("reshard_after_forward", "all"))
    has_layers = any(b.startswith("layers.") for b in names)
    expert_buffers = 0
    if layout["expert_group_size"] > 1:  # dispatched and combined tokens of one layer
        expert_buffers = 2 * tokens * model_cfg.top_k * model_cfg.dim * compute_bytes
    memory = MemoryModel(
        layout=layout,
        state=state,
        offload=offload,
        model_buffers=shapes.buffer_bytes,
        compute_bytes=compute_bytes,
        reduce_bytes=reduce_bytes,
        activations=acts,
        expert_buffers=expert_buffers,
        kept_blocks=kept_gathered,
        micro_batches=training.grad_accum_steps,
        attention_gradients=attention_gradient_bytes(config, hardware.attention_kernel)
        if has_layers
        else 0,
        attention_scores=logit_max_scores_bytes(config, hardware) if has_layers else 0,
    )
    moments = memory.moments(rank)
    top = peak(moments)
    device_terms = {**top.terms, **device_staging, "reserved": hardware.reserved_bytes}
    host_terms = {"activations": acts.host, "optimizer_state": optimizer_on_host, **host_staging}
    ranks_per_node = min(world_size, hardware.gpus_per_node)
    host_capacity = (
        offload.budget_bytes_per_rank
        if offload.budget_bytes_per_rank is not None
        else hardware.host_bytes_per_rank()
    )
    traffic_inputs = dict(
        layout=layout,
        world_size=world_size,
        replicas=mesh[0],
        gpus_per_node=per_node,
        compute_bytes=compute_bytes,
        reduce_bytes=reduce_bytes,
        micro_batches=training.grad_accum_steps,
        host_bytes_per_micro_batch=host_per_micro_batch,
        host_optimizer_bytes=optimizer_on_host,
        kept_blocks=kept_gathered,
        root_kept=scope is None,  # a stage's root parts are gathered again for backward
        rails=hardware.device == "cuda",  # NCCL's ring a rail, a network link a GPU
        clip_maxima=clip_maxima(config, scope.run_world_size if scope else world_size),
        context_exchange=(
            exchange_bytes_per_pass(config, scope.layers if scope else model_cfg.n_layers),
            config.parallel.cp,
            recompute,
        ),
    )
    traffic = step_traffic(**traffic_inputs)
    checkpoint = unique_state_bytes(shapes.parameters, config.optimizer.name)
    write_s = write_seconds(
        checkpoint,
        world_size // per_node,
        per_node,
        hardware.filesystem_gbps,
        config.checkpoint.max_write_mbps,
    )
    # A restarted replica group heals from the same rank of another: groups are
    # world / replicas ranks apart (dp_replicate is the outermost data axis).
    heal_link = strided_link(mesh[0], world_size // mesh[0], per_node)
    heal_s = heal_seconds(stage, hardware.bandwidth(heal_link, "point_to_point"))
    layers = scope.layers if scope is not None else model_cfg.n_layers
    per_token = model_flops_per_token(shapes, model_cfg, training.seq_len, layers)
    tokens_per_rank = tokens * training.grad_accum_steps
    # Recomputation repeats the blocks' forward (a third of the work), not the head's.
    head = 2 * model_cfg.vocab_size * model_cfg.dim if scope is None or scope.head else 0
    recompute_flops = per_token // 3 - head if recompute else 0
    upprojection = upprojection_flops(config, layers)  # the latent exchange's, all micro-batches
    hardware_flops = (per_token + recompute_flops) * tokens_per_rank + upprojection
    # "With overlap": what europa-overlap says it hides, or (not enabled) every
    # kind that can run beside compute, as the estimate of what it would give.
    overlappable = tuple(t.kind for t in traffic if t.overlappable)
    overlapped = tuple(plan.get("overlapped_kinds", overlappable))
    layout_overlapped = LAYOUT_OVERLAPPED
    if hardware.device == "cpu":  # gloo's collectives run on the cores that compute
        overlapped = layout_overlapped = ()

    compute = rank_compute(
        config,
        hardware,
        world_size,
        model_flops=per_token * tokens_per_rank,
        hardware_flops=hardware_flops,
        state_bytes=state.totals()[rank],
        layers=None if scope is None else scope.layer_indices,
        head=scope is None or scope.head,
        maxima_flops=logit_max_flops(config, hardware, layers),
    )

    windows = query_windows(
        compute, query_projection_flops(config, layers), hardware_flops, recompute
    )

    def priced(overlapped_kinds: tuple[str, ...]) -> StepTime:
        return step_time(
            compute,
            transfers(traffic, hardware, overlapped_kinds, windows),
            model_flops=per_token * tokens_per_rank,
            peak_flops=hardware.peak_flops(training.dtype),
        )

    return Plan(
        config=config,
        hardware=hardware,
        world_size=world_size,
        mesh=mesh,
        shapes=shapes,
        layout=layout,
        state=state,
        activations=acts,
        device_terms=device_terms,
        device_capacity=hardware.device_bytes_per_rank(ranks_per_node),
        host_terms=host_terms,
        host_capacity=host_capacity,
        traffic=traffic,
        without_overlap=priced(layout_overlapped),
        with_overlap=priced(overlapped),
        overlap_enabled="overlapped_kinds" in plan,
        model_flops_per_token=per_token,
        activations_by_mode={mode: a.device for mode, a in by_mode.items()},
        memory=memory,
        moments=moments,
        peak_moment=top.name,
        traffic_inputs=traffic_inputs,
        checkpoint_bytes=checkpoint,
        checkpoint_write_s=write_s,
        checkpoint_stage_bytes=stage,
        checkpoint_stage_s=stage / hardware.bandwidth(DEVICE_TO_HOST),  # a copy out
        checkpoint_read_s=read_seconds(stage, min(per_node, world_size), hardware.filesystem_gbps),
        heal_s=heal_s,
        heal_link=heal_link,
        host_budget_setting=offload.budget_setting if offload.budget_bytes_per_rank else "",
        plugins={k: v for k, v in plan.items() if k not in _CORE_KEYS},
    )
