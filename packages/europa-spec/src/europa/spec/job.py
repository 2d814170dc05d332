"""What a hook may rely on in the ``job`` it receives, phase by phase, as Protocols:
europa-core's ``Job`` satisfies both; a plugin types its hooks with them and needs
nothing of core.

While planning (``europa plan``, the launcher's pre-flight check, ``europa_build_model``
called for shapes) a job has the config and where the ranks stand, but no devices, no
mesh and no run directory of its own. On a rank, from the build phase on, it has all of
them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from europa.spec.execution import Execution

# The device mesh's axes, outermost first. An ``ep`` group is consecutive ranks; the
# ranks of one pipeline stage (``pp``) are its data-parallel ranks, ``DATA_AXES``.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "ep")
PIPELINE_AXIS = MESH_AXES[0]
DATA_AXES = MESH_AXES[1:]
# ``job.state[STAGE_MODULES]``, with pipeline stages: this rank's stages, each its module
# names in forward order ("embedding", "layers.3", ..., "norm", "output"), set by the
# trainer before ``europa_shard_model``; absent without stages.
STAGE_MODULES = "pipeline_stage_modules"
# ``job.state[CONTEXT_GATHER_EARLY]``: True when a plugin overlaps communication with compute
# (europa-overlap, in ``europa_wrap_model``); context parallelism then issues each layer's
# gather before its query projection and waits after it.
CONTEXT_GATHER_EARLY = "context_gather_early"


@runtime_checkable
class PlanningJob(Protocol):
    config: Any  # the resolved config: ``config.section(name)`` gives a plugin's table
    rank: int
    world_size: int
    ranks_per_node: int  # what the launcher or the planned machine says; 0: not said
    state: dict[str, Any]  # per-run objects a plugin shares between its own hooks

    @property
    def is_main(self) -> bool: ...

    @property
    def node_size(self) -> int: ...


@runtime_checkable
class RunningJob(PlanningJob, Protocol):
    run_dir: Path
    local_rank: int
    device: torch.device
    mesh: DeviceMesh  # MESH_AXES: [pp, dp_replicate, dp_shard, ep]
    emit_metrics: Callable[[dict[str, Any]], None]
    claims: dict[str, str]  # parameter name -> the plugin laying it out
    optimizer: Any  # the optimizer core steps, once built (see europa_wrap_optimizer)
    # set when the rank's program runs on fake tensors (europa plan --execute); None in a run
    execution: Execution | None

    def claim(self, owner: str, parameter_names: Iterable[str]) -> None: ...


__all__ = [
    "CONTEXT_GATHER_EARLY",
    "DATA_AXES",
    "MESH_AXES",
    "PIPELINE_AXIS",
    "STAGE_MODULES",
    "PlanningJob",
    "RunningJob",
]
