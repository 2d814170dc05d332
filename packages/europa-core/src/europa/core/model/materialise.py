"""Allocate and initialise a (possibly sharded) meta model.

Design note. torchtitan initialises in place with ``model.init_states()``. On a
sharded DTensor parameter, random init relies on DTensor's offset-based RNG
tracker, which exists only for accelerator meshes: on a CPU mesh every rank
draws the *same* numbers for its own shard, so e.g. experts 0-3 on rank 0 and
4-7 on rank 1 come out identical. We therefore initialise each sharded
parameter as a full tensor (one module at a time, every rank drawing from the
same seeded stream) and keep this rank's shard. The result equals a
single-process initialisation bit for bit, for any world size; the memory
peak is one module's full parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.module import Module as TitanModule


def _init_own_parameters_unsharded(module: TitanModule, original) -> None:
    sharded = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    full = {
        n: torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
        for n, p in sharded.items()
    }
    for name, tensor in full.items():
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    try:
        original(module)
    finally:
        for name, param in sharded.items():
            shard = distribute_tensor(
                full[name], param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            with torch.no_grad():
                param.to_local().copy_(shard)
            module._parameters[name] = param


@contextlib.contextmanager
def _unsharded_parameter_init() -> Iterator[None]:
    original = TitanModule._init_self_parameters

    def patched(self: TitanModule) -> None:
        _init_own_parameters_unsharded(self, original)

    TitanModule._init_self_parameters = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        TitanModule._init_self_parameters = original  # type: ignore[method-assign]


def materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the meta parameters on ``device`` and initialise them from ``seed``."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad(), _unsharded_parameter_init():
        model.init_states(buffer_device=device)
