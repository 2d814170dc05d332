"""The records a layout and its gather units share: where each parameter lives (``Slot``)
and which ranks the layout spans (``Groups``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn


@dataclass
class Slot:
    """One parameter under the layout: where it is registered and what this rank holds."""

    name: str
    module: nn.Module
    attr: str
    index: int  # position within its unit
    start: int  # first matrix this rank owns
    stop: int

    @property
    def local(self) -> nn.Parameter:
        return self.module._parameters[self.attr]


@dataclass(frozen=True)
class Groups:
    """The ranks a layout spans: ``shard`` holds one copy, split by ownership;
    ``replicate`` (optional) joins the ranks holding the same share in other copies.
    ``direct``: gathers and reduce-scatters are direct transfers between ranks
    (``europa.flexshard.direct``), not the backend's collectives. ``mean``: a gradient is
    the mean over the data-parallel ranks; False: their sum (for a loss each rank already
    divided by the global token count, as torchtitan's is)."""

    shard: dist.ProcessGroup | None
    rank: int
    size: int
    replicate: dist.ProcessGroup | None = None
    replicas: int = 1
    direct: bool = False
    mean: bool = True
