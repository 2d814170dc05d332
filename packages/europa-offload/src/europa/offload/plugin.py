"""``europa train -p offload``: europa's hooks over this package's plain API.

Imports only pluggy and the standard library at module level (torch when a
hook runs); ``job`` is one of europa-spec's protocols (``RunningJob``, or
``PlanningJob`` in ``europa_plan``): ``job.config`` (its ``optimizer`` and
``offload`` tables), ``job.device``, ``job.state``, ``job.optimizer``.
``job.state["offload"]`` holds the run's ``ActivationOffload`` (its pool and
statistics) and, with ``optimizer_state``, the ``OffloadedOptimizer``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from europa.offload.errors import OffloadError
from europa.spec.hookspecs import hookimpl
from europa.spec.optim import FP32, STATE_TENSORS
from europa.spec.units import GIB

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from europa.spec.job import PlanningJob, RunningJob
    from europa.spec.plan_mapping import PlanMapping, SearchInputs

NAME = "offload"


@dataclass(kw_only=True)
class OffloadConfig:
    activations: bool = field(
        default=True, metadata={"doc": "offload the saved activations of the blocks"}
    )
    blocks: list[str] = field(
        default_factory=lambda: ["layers.*"],
        metadata={"doc": "module-name patterns of the blocks whose activations are offloaded"},
    )
    keep_last_blocks: int = field(
        default=1, metadata={"ge": 0, "doc": "the last N blocks keep their activations"}
    )
    min_tensor_kib: int = field(
        default=256, metadata={"ge": 0, "doc": "smaller saved tensors stay on the device"}
    )
    optimizer_state: bool = field(
        default=False, metadata={"doc": "keep optimizer state in host memory between steps"}
    )
    optimizer_chunk_mib: int = field(
        default=256, metadata={"gt": 0, "doc": "optimizer state streamed to the device at once"}
    )
    host_memory_gib: float = field(
        default=0.0,
        metadata={"ge": 0, "doc": "host memory this rank may use; 0: available / local ranks"},
    )


@hookimpl
def europa_config_sections() -> dict[str, type]:
    return {NAME: OffloadConfig}


def host_budget_bytes(table: OffloadConfig, job: RunningJob | None = None) -> int:
    """``host_memory_gib``, or the planned machine's host memory a rank has when the job is
    an execution on fake tensors (``europa.spec.execution``), or this machine's available
    memory shared by its local ranks."""
    if table.host_memory_gib:
        return int(table.host_memory_gib * GIB)
    execution = getattr(job, "execution", None)
    if execution is not None and execution.host_bytes_per_rank is not None:
        return execution.host_bytes_per_rank
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if "MemAvailable" in line)
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _blocks(model, patterns):
    """The outermost modules whose names match ``patterns``, in forward order."""
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(c + ".") for c in chosen):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            chosen.append(name)
            yield name, module


@hookimpl
def europa_wrap_model(job: RunningJob, model: torch.nn.Module) -> None:
    from europa.offload.activations import ActivationOffload, OffloadPolicy
    from europa.offload.pool import HostBufferPool

    table = job.config.section(NAME)
    pool = HostBufferPool(limit_bytes=host_budget_bytes(table, job))
    offload = ActivationOffload(
        OffloadPolicy(
            min_bytes=table.min_tensor_kib * 1024,
            patterns=("*",),
            keep_last_blocks=table.keep_last_blocks,
        ),
        pool,
    )
    if table.activations:
        matched = list(_blocks(model, table.blocks))
        if not matched:
            raise OffloadError(
                f"offload.blocks = {table.blocks!r}: no module of the model matches; expected "
                "patterns of block names such as 'layers.*'"
            )
        offload.wrap(matched)
    job.state[NAME] = offload


@hookimpl
def europa_wrap_optimizer(job: RunningJob) -> None:
    table = job.config.section(NAME)
    if not table.optimizer_state:
        return
    from europa.offload.optimizer import OffloadedOptimizer
    from europa.offload.pool import human

    offload = job.state[NAME]
    needed = sum(
        p.numel() * FP32 * STATE_TENSORS[job.config.optimizer.name]
        for group in job.optimizer.param_groups
        for p in group["params"]
    )
    offload.pool.reserved_bytes = needed
    if offload.pool.limit_bytes is not None and needed > offload.pool.limit_bytes:
        raise OffloadError(
            f"offload.host_memory_gib = {offload.pool.limit_bytes / GIB:.3g}: this rank's "
            f"optimizer state alone needs {human(needed)} of host memory; expected a "
            "larger budget, more ranks or offload.optimizer_state = false"
        )
    job.optimizer = OffloadedOptimizer(job.optimizer, chunk_bytes=table.optimizer_chunk_mib << 20)


@hookimpl
def europa_step_context(job: RunningJob, step: int) -> AbstractContextManager[None] | None:
    offload = job.state.get(NAME)

    @contextlib.contextmanager
    def released_after_step():
        try:
            yield
        finally:
            offload.release()

    return released_after_step() if offload is not None else None


@hookimpl
def europa_after_step(job: RunningJob, step: int, metrics: dict[str, Any]) -> None:
    offload = job.state[NAME]
    metrics.update(offload.take_stats().as_metrics())
    metrics["offload_pool_allocations"] = offload.pool.allocations
    metrics["offload_host_bytes"] = offload.pool.allocated_bytes + offload.pool.reserved_bytes


@hookimpl
def europa_search_levers(
    config: Any, world_size: int, ranks_per_node: int, plan: SearchInputs
) -> list[list[dict[str, Any]]]:
    """One lever: nothing offloaded, the saved activations, the optimizer state, or both."""

    def offload(activations: bool, optimizer_state: bool) -> dict:
        return {
            "plugins": [NAME],
            "set": {f"{NAME}.activations": activations, f"{NAME}.optimizer_state": optimizer_state},
        }

    return [
        [
            {"plugins": [], "set": {}},
            offload(True, False),
            offload(False, True),
            offload(True, True),
        ]
    ]


@hookimpl
def europa_plan(job: PlanningJob, plan: PlanMapping) -> None:
    """Fill ``plan["host_offload"]`` (europa-core's planner reads it: which blocks'
    saved tensors move, the size threshold, whether optimizer state lives in
    host memory and the chunk streamed back, the host budget when one is set;
    without ``host_memory_gib`` the hardware profile's host memory applies), and
    ``plan["offload"]`` with the same choices for the report."""
    table = job.config.section(NAME)
    budget = int(table.host_memory_gib * GIB) if table.host_memory_gib else None
    choices = {
        "activation_blocks": list(table.blocks) if table.activations else [],
        "keep_last_blocks": table.keep_last_blocks,
        "min_tensor_bytes": table.min_tensor_kib * 1024,
        "optimizer_state": table.optimizer_state,
        "optimizer_chunk_bytes": table.optimizer_chunk_mib << 20,
        "budget_bytes_per_rank": budget,
        "budget_setting": f"{NAME}.host_memory_gib = {table.host_memory_gib:g}",
    }
    plan["host_offload"] = choices
    plan[NAME] = dict(choices)
