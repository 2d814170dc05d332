"""What every hook receives: the resolved config and where this process stands."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from europa.core.errors import PluginError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from europa.core.config.schema import EuropaConfig
    from europa.spec.execution import Execution


@dataclass
class Job:
    """``emit_metrics`` writes a record (rank 0's sink; a no-op elsewhere).
    ``claims`` maps parameter name -> the plugin laying it out. ``state`` is
    where plugins keep per-run objects they share between their own hooks.
    ``optimizer`` is the optimizer core steps, once built (see
    ``europa_wrap_optimizer``). ``execution`` is set when the rank's program runs on fake
    tensors (``europa plan --execute``, ``europa.spec.execution``); None in a run."""

    config: EuropaConfig
    run_dir: Path
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ranks_per_node: int = 0  # what the launcher (or a planned machine) says; 0: not said
    device: torch.device | None = None
    mesh: DeviceMesh | None = None
    emit_metrics: Callable[[dict[str, Any]], None] = lambda record: None
    claims: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    optimizer: Any = None
    execution: Execution | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node_size(self) -> int:
        """Ranks sharing one node: ``parallel.ranks_per_node``, else the launcher's, else all."""
        from europa.core.launch.distributed import ranks_per_node

        return ranks_per_node(self.config.parallel, self.world_size, self.ranks_per_node)

    def claim(self, owner: str, parameter_names: Iterable[str]) -> None:
        """Record that ``owner`` lays out these parameters; a second owner is an error."""
        for name in parameter_names:
            previous = self.claims.setdefault(name, owner)
            if previous != owner:
                raise PluginError(
                    f"parameter {name!r} is claimed by both {previous} and {owner}: "
                    "expected exactly one sharding plugin per parameter"
                )
