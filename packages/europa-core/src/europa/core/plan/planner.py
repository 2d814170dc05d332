"""``make_plan``: will this config fit, and how fast will it go?

The model is built on the meta device, exactly as ``europa train`` builds it
(through ``europa_build_model``); core's FSDP2 layout is the default and every
enabled plugin may change the plan through ``europa_plan`` (a sharding plugin
replaces ``plan["layout"]``, europa-offload fills ``plan["host_offload"]``,
europa-overlap ``plan["overlapped_kinds"]``). ``europa train``'s pre-flight
check calls the same function, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from europa.core.config.schema import EuropaConfig
from europa.core.errors import PluginError, ResourceError
from europa.core.job import Job
from europa.core.launch.distributed import check_node_layout, mesh_shape
from europa.core.plan.activations import block_activations
from europa.core.plan.builtin_layouts import FSDP2, data_parallel_form, fsdp2_layout
from europa.core.plan.checkpoint_cost import lost_per_save, write_seconds
from europa.core.plan.hardware import DEVICE_TO_HOST, HardwareProfile
from europa.core.plan.memory import (
    Activations,
    MemoryModel,
    RankState,
    activations,
    kept_blocks,
    unique_state_bytes,
)
from europa.core.plan.moments import Moment, peak
from europa.core.plan.shapes import ModelShapes
from europa.core.plan.timing import (
    LAYOUT_OVERLAPPED,
    StepTime,
    model_flops_per_token,
    step_time,
)
from europa.core.plan.traffic import Traffic, step_traffic

if TYPE_CHECKING:
    from europa.core.plan.pipeline_plan import PipelinePlan
from europa.spec.offload import HostOffload
from europa.spec.plan_layout import Layout
from europa.spec.plan_mapping import PlanMapping
from europa.spec.units import human

MODES = ("none", "full")  # activation_checkpointing.mode
STAGING = "checkpoint_staging"  # the memory term of an async save's host buffers
_CORE_KEYS = {
    "world_size",
    "parameter_shapes",
    "parameter_itemsize",
    "hardware",
    "layout",
    "host_offload",
    "overlapped_kinds",
}


@dataclass(frozen=True)
class Plan:
    config: EuropaConfig
    hardware: HardwareProfile
    world_size: int
    mesh: tuple[int, int, int]  # dp_replicate, dp_shard, ep
    shapes: ModelShapes
    layout: dict[str, Any]
    state: RankState
    activations: Activations
    device_terms: dict[str, int]  # the most loaded rank
    device_capacity: int
    host_terms: dict[str, int]
    host_capacity: int
    traffic: list[Traffic]
    without_overlap: StepTime
    with_overlap: StepTime
    overlap_enabled: bool
    model_flops_per_token: int
    activations_by_mode: dict[str, int] = field(default_factory=dict)  # device bytes
    checkpoint_bytes: int = 0  # every parameter and optimizer tensor once
    # its write at the profile's file-system bandwidth (or checkpoint.max_write_mbps, where
    # lower), each node writing its ranks' even share (None: the profile does not say it)
    checkpoint_write_s: float | None = None
    # What an async save copies into host memory on the most loaded rank, whatever the
    # mode (its parameters and optimizer state as it holds them), and that copy's time.
    checkpoint_stage_bytes: int = 0
    checkpoint_stage_s: float = 0.0
    host_budget_setting: str = ""
    plugins: dict[str, Any] = field(default_factory=dict)
    memory: MemoryModel | None = None  # recomputes the moments for any rank
    moments: list[Moment] = field(default_factory=list)  # the most loaded rank's
    peak_moment: str = ""  # the moment device_terms are taken at
    traffic_inputs: dict[str, Any] = field(default_factory=dict)  # step_traffic's, for traffic_of
    # With pipeline stages: every pipeline rank's figures (the rest is the heaviest rank's)
    pipeline: PipelinePlan | None = None

    @property
    def device_total(self) -> int:
        return sum(self.device_terms.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_terms.values())

    @property
    def fits_device(self) -> bool:
        return self.device_total <= self.device_capacity

    @property
    def fits_host(self) -> bool:
        return self.host_total <= self.host_capacity

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def step(self) -> StepTime:
        """The step as planned: with overlap where europa-overlap is enabled."""
        return self.with_overlap if self.overlap_enabled else self.without_overlap

    @property
    def checkpoint_staging_bytes(self) -> int:
        """The staging buffers the configured mode holds (none for "sync")."""
        return self.checkpoint_stage_bytes if self.config.checkpoint.mode == "async" else 0

    @property
    def checkpoint_lost_s(self) -> dict[str, float | None]:
        """Training seconds one save costs, by ``checkpoint.mode`` (a prediction)."""
        return lost_per_save(
            self.checkpoint_write_s,
            self.checkpoint_stage_s,
            self.config.checkpoint.every,
            self.step.step_s,
        )

    @property
    def tokens_per_step(self) -> int:
        t = self.config.training
        data_ranks = self.world_size // self.config.parallel.pp  # a pipeline's read the same
        return t.batch_size * t.seq_len * t.grad_accum_steps * data_ranks

    def rank_state(self, global_rank: int) -> dict[str, int]:
        """State bytes of one global rank (ranks of a replica group hold the same)."""
        r = global_rank % self.layout["group_size"]
        return {
            "parameters": self.state.parameters[r],
            "gradients": self.state.gradients[r],
            "optimizer_state": self.state.optimizer_state[r],
        }

    def terms_of(self, global_rank: int) -> tuple[dict[str, int], dict[str, int]]:
        """(device, host) memory terms of one global rank at its own peak moment."""
        r = global_rank % self.layout["group_size"]
        top = peak(self.memory.moments(r))
        fixed = {k: v for k, v in self.device_terms.items() if k in (STAGING, "reserved")}
        host = dict(self.host_terms)
        if host.get("optimizer_state"):
            host["optimizer_state"] = self.state.optimizer_state[r]
        return {**top.terms, **fixed}, host

    def traffic_of(self, global_rank: int) -> list[Traffic]:
        """The bytes one global rank sends per step: ``traffic`` with that rank's own
        optimizer state where europa-offload moves it."""
        inputs = dict(self.traffic_inputs)
        r = global_rank % self.layout["group_size"]
        if inputs.get("host_optimizer_bytes"):
            inputs["host_optimizer_bytes"] = self.state.optimizer_state[r]
        layout = inputs["layout"] = dict(inputs["layout"])
        experts = layout.get("expert_stored_elements")
        if experts is not None:  # the replicas sum what is not an expert
            layout["replicated_elements"] = layout["stored_elements"][r] - experts[r]
        roots = layout.get("root_stored_elements")
        if roots and layout.get("replica_group"):
            layout["replica_group"] = dict(layout["replica_group"], tail_elements=roots[r])
        return step_traffic(**inputs, rank=global_rank % layout["gather_group_size"])

    def refusal(self) -> str | None:
        """The one line both ``europa plan`` and ``europa train`` print when it does not fit."""
        where = f"{self.config.run.name}: {self.world_size} rank(s) on {self.hardware.name}"
        if not self.fits_device:
            terms = ", ".join(f"{k} {human(v)}" for k, v in self.device_terms.items() if v)
            sync = 'checkpoint.mode = "sync", ' if self.device_terms.get(STAGING) else ""
            return (
                f"{where}: the most loaded rank needs {human(self.device_total)} of "
                f"{self.hardware.device} memory ({terms}) and has {human(self.device_capacity)}: "
                f"expected {sync}more ranks, a smaller micro-batch or sequence, "
                'activation_checkpointing.mode = "full", or -p offload'
            )
        if not self.fits_host:
            return self._host_refusal(where)
        return None

    def _host_refusal(self, where: str) -> str:
        source = f" ({self.host_budget_setting})" if self.host_budget_setting else ""
        staging = self.host_terms.get(STAGING, 0)
        offloaded = {k: v for k, v in self.host_terms.items() if k != STAGING and v}
        terms = ", ".join(f"{k} {human(v)}" for k, v in offloaded.items())
        if not staging:
            return (
                f"{where}: each rank moves {human(self.host_total)} to host memory ({terms}) "
                f"and has {human(self.host_capacity)}{source}: expected a larger budget, more "
                "ranks, or less offloaded"
            )
        offload = f"{human(sum(offloaded.values()))} offload ({terms}) + " if offloaded else ""
        less = "a larger budget, or less offloaded" if offloaded else "or a larger budget"
        return (
            f"{where}: each rank needs {human(self.host_total)} of host memory, {offload}"
            f'{human(staging)} checkpoint staging (checkpoint.mode = "async"), and has '
            f'{human(self.host_capacity)}{source}: expected checkpoint.mode = "sync", more '
            f"ranks, {less}"
        )

    def check(self) -> None:
        message = self.refusal()
        if message is not None:
            raise ResourceError(message)


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
        from europa.core.plan.pipeline_plan import plan_pipeline

        return plan_pipeline(config, plugins, hardware, world_size, shapes, job.node_size)
    plan = plugin_plan(job, plugins, shapes, hardware=hardware)
    return _assemble(config, hardware, world_size, mesh, shapes, plan, job.node_size)


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
    )
    blocks = [b for b in blocks if b.name in names]
    kept_bytes = plan["layout"].get("expert_kept_bytes_per_moe_block", 0)
    kept = {f"layers.{i}": kept_bytes for i in range(model_cfg.n_dense_layers, model_cfg.n_layers)}
    tokens = training.batch_size * training.seq_len
    return {mode: activations(blocks, tokens, mode == "full", offload, kept) for mode in MODES}


def _every_block(config) -> frozenset[str]:
    return frozenset([*(f"layers.{i}" for i in range(config.model.n_layers)), "<root>"])


def _assemble(
    config, hardware, world_size, mesh, shapes, plan, per_node, scope: StageScope | None = None
) -> Plan:
    training, model_cfg = config.training, config.model
    layout = plan["layout"]
    compute_bytes = 2 if training.dtype == "bfloat16" else 4
    reduce_bytes = layout.get("reduce_itemsize", 4)
    recompute = config.section("activation_checkpointing").mode == "full"
    offload = HostOffload.parse(plan.get("host_offload"))
    tokens = training.batch_size * training.seq_len
    names = scope.blocks if scope is not None else _every_block(config)
    by_mode = stage_activations(config, hardware, plan, names)
    acts = by_mode["full" if recompute else "none"]
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
        host_bytes_per_micro_batch=acts.host,
        host_optimizer_bytes=optimizer_on_host,
        kept_blocks=kept_gathered,
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
    layers = scope.layers if scope is not None else model_cfg.n_layers
    per_token = model_flops_per_token(shapes, model_cfg, training.seq_len, layers)
    tokens_per_rank = tokens * training.grad_accum_steps
    # Recomputation repeats the blocks' forward (a third of the work), not the head's.
    head = 2 * model_cfg.vocab_size * model_cfg.dim if scope is None or scope.head else 0
    recompute_flops = per_token // 3 - head if recompute else 0
    bandwidth = {(t.link, t.collective): hardware.bandwidth(t.link, t.collective) for t in traffic}
    # "With overlap": what europa-overlap says it hides, or (not enabled) every
    # kind that can run beside compute, as the estimate of what it would give.
    overlappable = tuple(t.kind for t in traffic if t.overlappable)
    overlapped = tuple(plan.get("overlapped_kinds", overlappable))
    layout_overlapped = LAYOUT_OVERLAPPED
    if hardware.device == "cpu":  # gloo's collectives run on the cores that compute
        overlapped = layout_overlapped = ()
    timing = dict(
        model_flops=per_token * tokens_per_rank,
        hardware_flops=(per_token + recompute_flops) * tokens_per_rank,
        peak_flops=hardware.peak_flops(training.dtype),
        matmul_efficiency=hardware.matmul_efficiency,
        traffic=traffic,
        bandwidth=bandwidth,
        micro_batches=training.grad_accum_steps,
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
        without_overlap=step_time(**timing, overlapped_kinds=layout_overlapped),
        with_overlap=step_time(**timing, overlapped_kinds=overlapped),
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
        host_budget_setting=offload.budget_setting if offload.budget_bytes_per_rank else "",
        plugins={k: v for k, v in plan.items() if k not in _CORE_KEYS},
    )
