"""Muon for hidden matrices, AdamW for everything else, in one optimizer.

Why not ``torch.optim.Muon``: it accepts only 2-D parameters (routed experts
are stacked ``[experts, rows, cols]`` tensors, most of an MoE's weights), it
always orthogonalises in bf16 (which a CPU without bf16 units runs 10-50x
slower: ``benchmarks/expert_dtype.py`` measures the bf16 matmul on your machine),
and it does not know that a sharded matrix must be whole
before it is orthogonalised. This implementation uses the same quintic
Newton–Schulz iteration and coefficients in the parameter's dtype, treats a
3-D parameter as a batch of independent matrices (``europa.spec.muon``, which
every layout shares), and works on FSDP2's DTensor shards:

* a parameter sharded along its expert dimension holds whole matrices
  locally, so it is orthogonalised with no communication;
* any other sharded matrix is gathered (``full_tensor``), orthogonalised,
  and each rank keeps its own shard (``src_data_rank=None``: no scatter).

The learning rate is scaled per matrix by ``0.2 * sqrt(max(rows, cols))`` so
the update RMS matches AdamW's and one ``lr`` serves both groups (Moonlight,
arXiv:2502.16982).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from europa.spec.muon import (
    adamw_keywords,
    adamw_state,
    adamw_update,
    apply_muon_update,
    closure_loss,
    muon_adamw_defaults,
    nesterov_momentum,
    orthogonalise,
)

__all__ = ["MuonWithAdamW", "orthogonalise"]


def _holds_whole_matrices(param: DTensor) -> bool:
    """Sharded only along a leading (batch/expert) dimension of a stacked parameter."""
    return all(not isinstance(p, Shard) or p.dim < param.ndim - 2 for p in param.placements)


def _orthogonalised_update(update: torch.Tensor, steps: int) -> torch.Tensor:
    if not isinstance(update, DTensor):
        return orthogonalise(update, steps)
    if _holds_whole_matrices(update):
        local = orthogonalise(update.to_local(), steps)
        return DTensor.from_local(
            local,
            update.device_mesh,
            update.placements,
            shape=update.shape,
            stride=update.stride(),
        )
    full = orthogonalise(update.full_tensor(), steps)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


class MuonWithAdamW(torch.optim.Optimizer):
    """``hyperparameters``: ``lr`` and the rest of ``europa.spec.muon.muon_adamw_defaults``."""

    def __init__(
        self,
        muon_params: Iterable[torch.Tensor],
        adamw_params: Iterable[torch.Tensor],
        **hyperparameters: Any,
    ) -> None:
        groups = [
            {"params": list(muon_params), "use_muon": True},
            {"params": list(adamw_params), "use_muon": False},
        ]
        defaults = muon_adamw_defaults(**hyperparameters)
        super().__init__([g for g in groups if g["params"]], defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                for param in stepped:
                    self._muon_update(param, group)
            elif stepped:
                self._adamw_update(stepped, group)
        return loss

    def _muon_update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        nesterov = nesterov_momentum(param, state["momentum_buffer"], group["momentum"])
        apply_muon_update(param, _orthogonalised_update(nesterov, group["ns_steps"]), group)

    def _adamw_update(self, params: list[torch.Tensor], group: dict) -> None:
        """torch's fused AdamW kernel on the whole group (``europa.spec.muon``)."""
        for param in params:
            if "step" not in self.state[param]:
                self.state[param].update(adamw_state(param))
        adamw_update(params, [self.state[p] for p in params], **adamw_keywords(group))
