"""A plan: what ``make_plan`` returns, and the figures of its pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from europa.core.config.schema import EuropaConfig
from europa.core.errors import ResourceError
from europa.core.plan.checkpoint_cost import lost_per_save
from europa.core.plan.context import sequence_groups
from europa.core.plan.goodput import Goodput, estimate
from europa.core.plan.hardware import HardwareProfile
from europa.core.plan.memory import Activations, MemoryModel, RankState
from europa.core.plan.moments import Moment, peak
from europa.core.plan.shapes import ModelShapes
from europa.core.plan.traffic import Traffic, step_traffic
from europa.plan.exposure import StepTime
from europa.spec.units import human

STAGING = "checkpoint_staging"  # the memory term of an async save's host buffers


@dataclass(frozen=True)
class PipelineRank:
    rank: int  # its place on the pipeline axis
    stages: tuple[int, ...]
    modules: tuple[str, ...]
    device_bytes: int  # at its peak, the micro-batches it holds included
    held_micro_batches: float  # the most saved activations it holds, in micro-batches
    send_bytes: int  # per step: hidden states and gradients to other pipeline ranks
    busy_s: float  # its stages' compute and own exposed traffic
    bubble: float  # the share of the step it waits


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    pp: int
    stages: int
    micro_batches: int
    stage_modules: tuple[tuple[str, ...], ...]  # every stage's modules, in order
    ranks: tuple[PipelineRank, ...]
    hidden_bytes: int  # one micro-batch's hidden state (or its gradient) between stages
    link: str  # the link a stage transfer crosses
    step_s: float
    # what running DualPipeV's paired chunks side by side saves: expert exchange hidden
    # behind the other chunk's compute (0: another schedule, or pp_overlap_f_b = "off")
    paired_hidden_s: float = 0.0

    @property
    def bubble(self) -> float:
        """The share of the step the pipeline's ranks wait, on average."""
        return sum(r.bubble for r in self.ranks) / len(self.ranks)


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
    # A full restart's read of the last checkpoint, each node reading its ranks' state (None:
    # the profile has no filesystem_gbps), and, with replica groups, a restarted group's heal
    # from a healthy one over heal_link (europa.core.plan.goodput); with pipeline stages, the
    # slowest pipeline rank's
    checkpoint_read_s: float | None = None
    heal_s: float = 0.0
    heal_link: str = ""
    host_budget_setting: str = ""
    plugins: dict[str, Any] = field(default_factory=dict)
    memory: MemoryModel | None = None  # recomputes the moments for any rank
    moments: list[Moment] = field(default_factory=list)  # the most loaded rank's
    peak_moment: str = ""  # the moment device_terms are taken at
    traffic_inputs: dict[str, Any] = field(default_factory=dict)  # step_traffic's, for traffic_of
    # With pipeline stages: every pipeline rank's figures (the rest is the heaviest rank's)
    pipeline: PipelinePlan | None = None
    # and each pipeline rank's own plan, over its stage's data ranks (its layers alone)
    pipeline_rank_plans: tuple[Plan, ...] = ()

    def rank_view(self, global_rank: int) -> tuple[Plan, int]:
        """The plan that holds ``global_rank``'s own figures and its rank there: with
        pipeline stages its pipeline rank's plan (``pp`` is the outermost mesh axis), else
        this one."""
        if not self.pipeline_rank_plans:
            return self, global_rank
        data_ranks = self.world_size // self.config.parallel.pp
        return self.pipeline_rank_plans[global_rank // data_ranks], global_rank % data_ranks

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
    def goodput(self) -> Goodput:
        """The share of wall time that trains under the profile's failure rate, without and
        with replica fault tolerance (a prediction: ``europa.core.plan.goodput``)."""
        return estimate(
            failures_per_gpu_hour=self.hardware.failures_per_gpu_hour,
            gpus=self.world_size,
            restart_s=self.hardware.restart_s,
            read_s=self.checkpoint_read_s,
            heal_s=self.heal_s,
            heal_link=self.heal_link,
            replicas=self.mesh[0],
            mode=self.config.checkpoint.mode,
            every=self.config.checkpoint.every,
            step_s=self.step.step_s,
            write_s=self.checkpoint_write_s,
            staging_s=self.checkpoint_stage_s,
        )

    @property
    def tokens_per_step(self) -> int:
        t = self.config.training
        readers = sequence_groups(self.config.parallel, self.world_size)
        return t.batch_size * t.seq_len * t.grad_accum_steps * readers

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
