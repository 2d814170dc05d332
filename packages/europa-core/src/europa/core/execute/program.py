"""One rank's program of one optimizer step, executed on fake tensors at the planned size.

Run in a process of its own (``python -m europa.core.execute.program SPEC.json OUT.json``):
the fake process group, the stand-in accelerator and the patched ``torch.distributed``
entry points are process-wide. The program is the trainer's, through the same hooks in
the same order (``europa.core.train.assemble``), with no data:

build → shard → wrap → materialise (nothing drawn: values do not exist) → optimizer →
one step (every micro-batch's forward and backward, QK-clip's maxima and their reduce,
the once-a-step sums, clipping, the expert-bias update, the optimizer step, then
QK-clip's scaling where values exist) → a checkpoint save's planning (what DCP would
write, not the write) → teardown. With pipeline stages the rank keeps its stages' modules
and torch's schedule runs the micro-batches, as the trainer's do; the stages' sends to
the other pipeline ranks return at once like every collective (nothing arrives: fake
tensors hold no values).

What it does not run: data loading (micro-batches are token-id tensors of the configured
shape), the metrics a step writes (``europa_after_step``), and the write itself.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from europa.core.execute import standin
from europa.core.execute.fake import FakeDeviceMode
from europa.core.execute.ledger import DEVICE, HOST, MemoryLedger
from europa.core.execute.traffic import TrafficCount
from europa.spec.execution import Execution, RoutingModel


@dataclass(frozen=True)
class RankSpec:
    """What a rank's execution needs, as plain values (the parent writes it as JSON)."""

    config_path: str  # the resolved config, as TOML
    rank: int
    world_size: int
    ranks_per_node: int
    device: str  # the planned device type: "cuda" (the stand-in runs it) or "cpu"
    backend: str  # "nccl" or "gloo": the transfers the planned run takes
    routing: str  # RoutingModel.parse's form
    host_bytes_per_rank: int | None = None

    def execution(self) -> Execution:
        return Execution(
            routing=RoutingModel.parse(self.routing),
            backend=self.backend,
            host_bytes_per_rank=self.host_bytes_per_rank,
        )


def _fake_process_group(rank: int, world: int, device: torch.device) -> None:
    """torch's fake group, for the host and for ``device`` (a batch of point-to-point
    transfers, a pipeline's, asks the group for the device's own backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    backend = "fake" if device.type == "cpu" else f"cpu:fake,{device.type}:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)


def _local_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if not p.is_meta]


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # europa-offload's wrapper
    return [
        value
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def execute(spec: RankSpec) -> dict[str, Any]:
    """The rank of ``spec`` on fake tensors and the fake process group (this process's)."""
    from torch.distributed.device_mesh import init_device_mesh

    from europa.core.job import Job
    from europa.core.launch.distributed import MESH_AXES, mesh_shape
    from europa.core.session import open_session

    started = time.perf_counter()
    config, manager = open_session(Path(spec.config_path))
    device = standin.install() if spec.device == "cuda" else torch.device("cpu")
    _fake_process_group(spec.rank, spec.world_size, device)
    mesh = init_device_mesh(
        device.type, mesh_shape(config.parallel, spec.world_size), mesh_dim_names=MESH_AXES
    )
    job = Job(
        config=config,
        run_dir=Path("."),
        rank=spec.rank,
        world_size=spec.world_size,
        local_rank=spec.rank % spec.ranks_per_node,
        ranks_per_node=spec.ranks_per_node,
        device=device,
        mesh=mesh,
        execution=spec.execution(),
    )
    ledger = MemoryLedger(device_type=device.type)
    traffic = TrafficCount(rank=spec.rank, per_node=job.node_size, rails=spec.backend == "nccl")
    mode = FakeDeviceMode(observers=[ledger, traffic])
    try:
        with mode:
            measured = run_step_program(job, manager, traffic, ledger)
    finally:
        dist.destroy_process_group()
    return {
        "rank": spec.rank,
        "world_size": spec.world_size,
        "device": spec.device,
        "backend": spec.backend,
        "routing": spec.routing,
        "stand_in": standin.STANDIN_NOTE if spec.device == "cuda" else None,
        **measured,
        "stand_in_reads": dict(mode.scalar_reads),
        "storages": ledger.storages(),
        "seconds": measured["seconds"] | {"total": time.perf_counter() - started},
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_step_program(
    job,
    manager,
    traffic: TrafficCount,
    ledger: MemoryLedger | None = None,
    initialiser=None,
    balanced_routing: bool = False,
) -> dict[str, Any]:
    """The trainer's phases and two steps on ``job`` (the second one counted), with its
    bytes in ``traffic`` and, with a ``ledger`` (fake tensors), its memory; then DCP's save
    planning. ``initialiser(model)``: what draws real values (default: nothing drawn, for
    fake tensors).
    ``balanced_routing``: torchtitan's round-robin routing, the exact counts of a uniform
    routing model where every expert gets the same share (a real run checked against its
    execution)."""
    from europa.core.model.load_balance import update_expert_bias
    from europa.core.pipeline.split import keep_rank_stages
    from europa.core.train.assemble import build_optimizer, place_model
    from europa.core.train.loop import logits_loss, next_token_loss
    from europa.spec.qk_clip_step import QKClip

    ledger = ledger or MemoryLedger(device_type=job.device.type)
    hook, training, device = manager.hook, job.config.training, job.device
    rows = training.seq_len // job.config.parallel.cp  # a rank's rows of each sequence
    seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(name: str, timed: str | None = None):
        ledger.phase = name
        begun = time.perf_counter()
        yield
        if timed:
            seconds[timed] = seconds.get(timed, 0.0) + time.perf_counter() - begun

    def step(index: int) -> None:
        with ExitStack() as stack:
            for context in hook.europa_step_context(job=job, step=index):
                if context is not None:
                    stack.enter_context(context)
            if pipeline is not None:  # the micro-batches stacked, as the trainer hands them
                shape = (training.batch_size * training.grad_accum_steps, rows)
                inputs = torch.zeros(shape, dtype=torch.long, device=device)
                with phase("forward", "forward_backward"), _chunk_phases(ledger):
                    pipeline.forward_backward(inputs, inputs)
            for _ in range(training.grad_accum_steps if pipeline is None else 0):
                shape = (training.batch_size, rows)
                inputs = torch.zeros(shape, dtype=torch.long, device=device)
                with phase("forward", "forward"):
                    loss = next_token_loss(model, inputs, inputs)
                with phase("backward", "backward"):
                    (loss / training.grad_accum_steps).backward()
            maxima = clip.agreed_maxima(device) if clip is not None else None
            with phase("optimizer", "optimizer"):
                ledger.name_state("gradients", [p.grad for p in _local_parameters(model)])
                hook.europa_clip_gradients(job=job, model=model, max_norm=training.max_grad_norm)
                update_expert_bias(model)
                job.optimizer.step()
                if maxima is not None and initialiser is not None:  # fake maxima: no values
                    factors = clip.row_factors(maxima)
                    hook.europa_scale_rows(job=job, model=model, factors=factors)
                ledger.name_state("optimizer_state", _optimizer_tensors(job.optimizer))
                job.optimizer.zero_grad(set_to_none=True)

    error, pipeline, clip = None, None, None
    try:
        with ledger, traffic:
            with phase("setup", "assemble"):
                model = hook.europa_build_model(job=job)
                if balanced_routing:
                    for module in model.modules():
                        if hasattr(module, "_debug_force_load_balance"):
                            module._debug_force_load_balance = True
                stage_names = None
                if job.config.parallel.pp > 1:
                    model, stage_names = keep_rank_stages(job, model)
                init_matrix = initialiser(model) if initialiser else _no_values
                model = place_model(job, manager, model, init_matrix)
                model.train()
                if job.config.parallel.cp > 1:
                    from europa.core.train import context_parallel

                    context_parallel.enable(job, model)
                if job.config.optimizer.qk_clip:
                    optimizer = job.config.optimizer
                    clip = QKClip(model, job.config.model.n_layers, optimizer.qk_clip_tau)
                if stage_names is not None:
                    from europa.core.pipeline.runner import PipelineRun

                    pipeline = PipelineRun(job, model, stage_names, logits_loss)
                    _stages_given_their_shapes(pipeline.schedule)
                ledger.name_state("parameters", _local_parameters(model))
                ledger.name_state("model_buffers", model.buffers())
                _, state = build_optimizer(job, manager, model)
            # The first step makes the optimizer state (on the device, where europa-offload
            # finds it to move); the second is every later step: it is the one measured.
            step(0)
            ledger.restart_peaks()
            traffic.counting = True
            step(1)
            traffic.counting = False
            peaks = {kind: ledger.peak(kind) for kind in (DEVICE, HOST)}
            by_phase = {kind: ledger.phase_peaks(kind) for kind in (DEVICE, HOST)}
            with phase("setup", "checkpoint_plan"):
                checkpoint = _checkpoint_plan(state, job.rank == 0)
    except BaseException as err:
        error = err
        raise
    finally:
        manager.teardown(job, error)
    return {
        "memory": {
            kind: asdict(peak) | {"by_phase": by_phase[kind]} for kind, peak in peaks.items()
        },
        "traffic": traffic.by_kind(),
        "calls": {f"{k}/{link}": n for (k, link), n in sorted(traffic.calls.items())},
        "checkpoint": checkpoint,
        "seconds": seconds,
    }


def _stages_given_their_shapes(schedule) -> None:
    """torch's schedule first asks every stage, over the pipeline group, whether it was
    given its inputs' and outputs' shapes (a warm-up vote); the fake group carries no
    answer. Every stage a ``PipelineRun`` builds is given them, which is what the vote
    finds in a run: so its result is set here, and no shape is inferred by sending one."""
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote


@contextlib.contextmanager
def _chunk_phases(ledger: MemoryLedger):
    """The ledger's phase follows the schedule's chunks: "backward" inside a stage's
    backward (whole, or either half of a split one), "forward" elsewhere."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    names = ("backward_one_chunk", "backward_weight_one_chunk")
    originals = {name: getattr(_PipelineStageBase, name) for name in names}

    def phased(original):
        def chunk(*args, **kwargs):
            ledger.phase = "backward"
            try:
                return original(*args, **kwargs)
            finally:
                ledger.phase = "forward"

        return chunk

    for name, original in originals.items():
        setattr(_PipelineStageBase, name, phased(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(_PipelineStageBase, name, original)


def _no_values(name: str, index: int, out: torch.Tensor) -> None:
    """Fake tensors hold no values: nothing to draw."""


def _checkpoint_plan(state, coordinator: bool) -> dict[str, Any]:
    """What this rank offers DCP to write: items and bytes of its local save plan."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from europa.core.checkpoint.store import checkpoint_content

    planner = DefaultSavePlanner()
    planner.set_up_planner(checkpoint_content(state, {"step": 1}), is_coordinator=coordinator)
    plan = planner.create_local_plan()
    tensor_bytes, items = 0, 0
    for item in plan.items:
        items += 1
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            chunk = item.tensor_data.chunk
            numel = 1
            for size in chunk.sizes:
                numel *= size
            tensor_bytes += numel * item.tensor_data.properties.dtype.itemsize
    return {"items": items, "tensor_bytes": tensor_bytes}


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = RankSpec(**json.loads(Path(spec_path).read_text()))
    result = execute(spec)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
