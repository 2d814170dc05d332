"""What a healing group receives from a healthy one, and a digest to check that the groups
agree.

Each rank sends its own model and optimizer state as it holds them (a shard, a whole
matrix, a DTensor's local part): ownership is positional, so rank ``k`` of the healing
group takes rank ``k``'s state as it is, with the trainer's own counters beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import crc32c
import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class ReplicaPlace:
    """This process's replica group: ``index`` of ``count``."""

    index: int
    count: int


def group_config(config):
    """The config a replica group trains with: its own ranks, without the replicate axis
    (the groups meet through torchft, not through the group's mesh)."""
    from dataclasses import replace

    return replace(config, parallel=replace(config.parallel, dp_replicate=1))


def replica_state(model, optimizer, trainer_state: dict) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "trainer": trainer_state,
    }


def load_replica_state(model, optimizer, state: dict) -> dict:
    """Load the model's and the optimizer's parts in place; return the trainer's."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            _local(tensor).copy_(_local(state["model"][name]))
    optimizer.load_state_dict(state["optimizer"])
    return state["trainer"]


def state_digest(model, optimizer) -> str:
    """A CRC32C of every parameter, buffer and optimizer-state tensor this rank holds."""
    value = 0
    for tensor in _tensors(model, optimizer):
        flat = _local(tensor).detach().contiguous().view(-1).view(torch.uint8)
        value = crc32c.crc32c(flat.cpu().numpy().tobytes(), value=value)
    return f"{value:08x}"


def _tensors(model, optimizer) -> Iterator[torch.Tensor]:
    yield from (t for _, t in sorted(model.state_dict().items()))
    state = optimizer.state_dict()["state"]
    for key in sorted(state):
        for _, value in sorted(state[key].items()):
            if isinstance(value, torch.Tensor):
                yield value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
