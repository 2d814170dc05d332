"""``europa train -p overlap``: europa's hooks over this package's plain API.

Imports only pluggy and the standard library at module level (torch when a
hook runs); ``job`` is used by duck typing: ``job.config`` (its ``overlap``
table, and ``parallel.ep``), ``job.node_size``, ``job.rank``, ``job.run_dir``,
``job.state``. It composes with the
layout that won ``europa_shard_model`` without importing it:

* europa-flexshard: ``job.state["flexshard"]`` is its layout; its ``units``
  (``GatherUnit``) take a prefetch schedule through ``set_prefetch`` and its
  ``cancel_prefetch()`` drops an unused one; expert-parallel MoE layers (a
  dispatcher with the chunked protocol's ``begin``) get the chunked, asynchronous
  exchange;
* core's FSDP2: the blocks of ``model.layers`` are FSDP modules
  (``set_modules_to_forward_prefetch`` and friends);
* europa-offload: its copies already run on a side stream ordered by events on
  CUDA (nothing to add; on a CPU-only machine there is no stream and a copy is
  a plain ``memcpy`` on the training thread);
* context parallelism (core's ``parallel.cp``): ``job.state[CONTEXT_GATHER_EARLY]``
  has each MLA layer issue its gather before the query projection and wait after it,
  and run that projection's backward beside the reduce-scatter.

``job.state["overlap"]`` holds an ``OverlapRun``: the ``Timeline`` (when
``overlap.timeline``), the layers whose all-to-all is overlapped, and the
prefetching layout. Each step adds ``overlap_*`` keys to ``metrics.jsonl``
(the mean over ranks) and, for the first ``overlap.trace_steps`` steps after the
first, writes each rank's intervals to ``RUN_DIR/overlap/timeline-rank<r>.jsonl``,
which ``europa trace RUN_DIR`` draws.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from europa.overlap.errors import OverlapError
from europa.spec.hookspecs import hookimpl
from europa.spec.job import CONTEXT_GATHER_EARLY, STAGE_MODULES
from europa.spec.plan_layout import CONTEXT_KINDS, RESHARD_POLICIES

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from europa.spec.job import PlanningJob, RunningJob
    from europa.spec.plan_mapping import PlanMapping, SearchInputs

NAME = "overlap"
# The planner's kinds that a layout already runs beside compute (FSDP2's own
# schedule; europa-core's plan.timing.LAYOUT_OVERLAPPED), which this plugin keeps.
LAYOUT_OVERLAPPED = (
    "parameter_gather",
    "gradient_reduce_scatter",
    "gradient_replica_all_reduce",
    "expert_gradient_all_reduce",
)
SUMMARY_KEYS = ("step_s", "compute_s", "comm_s", "exposed_comm_s", "hidden_comm_s")
KINDS = ("parameter_gather", "gradient_reduce_scatter", "expert_all_to_all", "all_reduce")


@dataclass(kw_only=True)
class OverlapConfig:
    prefetch_depth: int = field(
        default=1,
        metadata={"ge": 0, "doc": "blocks whose parameter all-gather is issued ahead (0: none)"},
    )
    reshard_after_forward: str = field(
        default="all",
        metadata={
            "choices": RESHARD_POLICIES,
            "doc": "blocks that free their gathered parameters after forward",
        },
    )
    reduce_scatter_async: bool = field(
        default=True,
        metadata={"doc": "FlexShard's gradient reduce-scatters run beside the rest of backward"},
    )
    expert_chunks: int = field(
        default=2,
        metadata={
            "ge": 0,
            "doc": "chunks of the overlapped expert exchange where it crosses nodes: of local "
            "experts (flat) or of tokens (two-level); 0: the layout's own exchange",
        },
    )
    expert_chunks_within_node: int = field(
        default=1,
        metadata={
            "ge": 0,
            "doc": "expert_chunks where each expert-parallel group lies inside one node (a copy "
            "over the node's own link, which a chunk cannot hide: it only adds a "
            "synchronisation); 0: the layout's own exchange",
        },
    )
    timeline: bool = field(
        default=True, metadata={"doc": "record compute and communication per step"}
    )
    trace_steps: int = field(
        default=4,
        metadata={"ge": 0, "doc": "steps (after the first) whose intervals europa trace draws"},
    )


@dataclass
class OverlapRun:
    timeline: Any = None
    layout: Any = None  # a layout with cancel_prefetch(), if its gathers are prefetched
    expert_layers: list[str] = field(default_factory=list)
    traced: int = 0


@hookimpl
def europa_config_sections() -> dict[str, type]:
    return {NAME: OverlapConfig}


def _flexshard_blocks(layout, model):
    root = next((u for u in layout.units if u.module is model), None)
    return [u for u in layout.units if u is not root], root


def stage_units(layout, model, stages: list[list[str]]) -> list[list]:
    """The layout's gather units stage by stage, each stage's in forward order."""
    name_of = {id(module): name for name, module in model.named_modules()}
    by_name = {name_of[id(unit.module)]: unit for unit in layout.units}
    chains = [[by_name[name] for name in names if name in by_name] for names in stages]
    placed = sum(len(chain) for chain in chains)
    if placed != len(layout.units):
        raise OverlapError(
            f"pipeline stages {stages}: expected every gather unit in one of them; "
            f"{len(layout.units) - placed} of {len(layout.units)} are in none"
        )
    return chains


def expert_chunks(job: PlanningJob) -> int:
    """The chunks of this run's expert exchange: ``expert_chunks_within_node`` where every
    expert-parallel group (``parallel.ep`` consecutive ranks) lies inside one node, else
    ``expert_chunks``."""
    table = job.config.section(NAME)
    within_node = job.config.parallel.ep <= job.node_size
    return table.expert_chunks_within_node if within_node else table.expert_chunks


@hookimpl(trylast=True)
def europa_wrap_model(job: RunningJob, model: torch.nn.Module) -> None:
    from europa.overlap.experts import overlap_expert_all_to_all
    from europa.overlap.prefetch import prefetch_fsdp, prefetch_gather_units
    from europa.overlap.timeline import Timeline

    table = job.config.section(NAME)
    run = OverlapRun()
    layout = job.state.get("flexshard")
    if layout is not None and hasattr(layout, "units"):
        stages = job.state.get(STAGE_MODULES)
        chains = [_flexshard_blocks(layout, model)]
        if stages is not None:  # a chain a stage: another stage's units run elsewhen
            chains = [(units, None) for units in stage_units(layout, model, stages)]
        for blocks, root in chains:
            prefetch_gather_units(
                blocks,
                table.prefetch_depth,
                table.reshard_after_forward,
                root,
                async_reduce=table.reduce_scatter_async,
            )
        run.layout = layout
    else:
        layers = getattr(model, "layers", None)
        blocks = list(layers.values() if hasattr(layers, "values") else layers or [])
        fsdp = [b for b in blocks if hasattr(b, "set_modules_to_forward_prefetch")]
        if fsdp:
            root = model if hasattr(model, "set_modules_to_forward_prefetch") else None
            prefetch_fsdp(fsdp, table.prefetch_depth, table.reshard_after_forward, root)
    chunks = expert_chunks(job)
    if chunks:
        run.expert_layers = overlap_expert_all_to_all(model, chunks)
    job.state[CONTEXT_GATHER_EARLY] = True
    if table.timeline:
        run.timeline = Timeline(job.rank).install()
    job.state[NAME] = run


@hookimpl
def europa_step_context(job: RunningJob, step: int) -> AbstractContextManager[None] | None:
    run = job.state.get(NAME)
    if run is None:
        return None

    @contextlib.contextmanager
    def overlapped_step():
        recording = run.timeline.step(step) if run.timeline else contextlib.nullcontext()
        with recording:
            try:
                yield
            finally:
                if run.layout is not None:
                    run.layout.cancel_prefetch()

    return overlapped_step()


def _mean_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return (tensor / dist.get_world_size()).tolist()


def step_metrics(summary: dict[str, float]) -> dict[str, float]:
    keys = [*SUMMARY_KEYS, *(f"{k}_s" for k in KINDS), *(f"{k}_exposed_s" for k in KINDS)]
    values = _mean_over_ranks([float(summary.get(k, 0.0)) for k in keys])
    out = {f"{NAME}_{k}": v for k, v in zip(keys, values, strict=True)}
    step = out[f"{NAME}_step_s"]
    out[f"{NAME}_exposed_comm_fraction"] = out[f"{NAME}_exposed_comm_s"] / step if step else 0.0
    return out


@hookimpl
def europa_after_step(job: RunningJob, step: int, metrics: dict[str, Any]) -> None:
    run = job.state.get(NAME)
    if run is None or run.timeline is None or run.timeline.last is None:
        return
    timeline = run.timeline.last
    metrics.update(step_metrics(timeline.summary()))
    table = job.config.section(NAME)
    first = 1 if job.config.training.steps > 1 else 0  # the first step warms up
    if step >= first and run.traced < table.trace_steps:
        run.timeline.write(job.run_dir)
        run.traced += 1


@hookimpl
def europa_search_levers(
    config: Any, world_size: int, ranks_per_node: int, plan: SearchInputs
) -> list[list[dict[str, Any]]]:
    """One lever: communication as the layout schedules it, or hidden behind compute, with
    every block's gathered parameters freed after its forward or all kept to its backward
    (no second gather, where the memory allows: the plan counts both)."""
    key = f"{NAME}.reshard_after_forward"
    return [
        [
            {"plugins": [], "set": {}},
            {"plugins": [NAME], "set": {key: "all"}},
            {"plugins": [NAME], "set": {key: "none"}},
        ]
    ]


@hookimpl
def europa_plan(job: PlanningJob, plan: PlanMapping) -> None:
    """Add ``plan["overlapped_kinds"]`` (europa-core's planner hides these kinds behind
    compute): the layout's own plus the expert all-to-all (in chunks: ``expert_chunks``),
    host copies (europa-offload's side-stream copies) and context parallelism's exchange
    (the planner's window: the query projection), and ``plan["overlap"]``."""
    table = job.config.section(NAME)
    kinds = [*LAYOUT_OVERLAPPED, *CONTEXT_KINDS]
    chunks = expert_chunks(job)
    if chunks:
        kinds.append("expert_all_to_all")
    kinds.append("host_copies")
    plan["overlapped_kinds"] = kinds
    plan["reshard_after_forward"] = table.reshard_after_forward
    plan[NAME] = {
        "prefetch_depth": table.prefetch_depth,
        "reshard_after_forward": table.reshard_after_forward,
        "expert_chunks": chunks,
    }


@hookimpl
def europa_register_commands(app: Any) -> None:
    @app.command("trace")
    def trace(run_dir: str, out: str = "") -> None:
        """Draw a run's compute and communication (europa-overlap's timelines): writes
        trace.html (one lane per rank; open it in a browser) and trace.json (Chrome
        trace format; open it in https://ui.perfetto.dev) into RUN_DIR, or --out."""
        from europa.overlap.trace import write_trace

        written = write_trace(Path(run_dir), Path(out) if out else None)
        for path in written:
            print(path, file=sys.stdout)


@hookimpl
def europa_teardown(job: RunningJob, error: BaseException | None) -> None:
    """The timeline patched torch.distributed's collectives process-wide: put them back."""
    run = job.state.get(NAME)
    if run is not None and run.timeline is not None:
        run.timeline.uninstall()
