"""Muon and AdamW on the whole matrices a rank owns: no collective in ``step()``.

Every local parameter of a ``FlexShardLayout`` is a stack of whole matrices,
so Muon's Newton–Schulz orthogonalisation, which needs a whole matrix, runs
where the matrix lives; the rank's Muon matrices are batched by shape into one
orthogonalisation each. AdamW is elementwise and needs nothing; it is europa-spec's
``adamw_update_any_split``, whose bits do not depend on how a rank's stacks are cut
between matrices (torch's fused kernel where that holds for it, the elementwise form
elsewhere), so every layout trains alike.

The maths is europa-spec's (``europa.spec.muon``), the same that europa-core's
``MuonWithAdamW`` runs: the quintic Newton–Schulz iteration in the parameter's
dtype, Nesterov momentum, decoupled weight decay, the update scaled by
``0.2 * sqrt(max(rows, cols))`` so that one ``lr`` serves both groups, and the
Muon/AdamW parameter rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from europa.flexshard.whole_matrix_layout import FlexShardLayout
from europa.spec.muon import (
    adamw_keywords,
    adamw_state,
    adamw_update_any_split,
    apply_muon_update,
    closure_loss,
    muon_adamw_defaults,
    nesterov_momentum,
    orthogonalise,
)
from europa.spec.optim import uses_muon

__all__ = ["FlexShardOptimizer", "orthogonalise"]


class FlexShardOptimizer(torch.optim.Optimizer):
    """``algorithm="muon"``: Muon on hidden matrices (``orthogonalised(name, shape)``),
    AdamW on the rest; ``algorithm="adamw"``: AdamW on everything. ``hyperparameters``:
    ``lr`` and the rest of ``europa.spec.muon.muon_adamw_defaults``. State is created at
    once (zeros), so a checkpoint can be loaded before the first step."""

    def __init__(
        self,
        layout: FlexShardLayout,
        *,
        algorithm: str = "muon",
        orthogonalised: Callable[[str, Sequence[int]], bool] = uses_muon,
        **hyperparameters: Any,
    ) -> None:
        if algorithm not in ("muon", "adamw"):
            raise ValueError(f"algorithm = {algorithm!r}: expected 'muon' or 'adamw'")
        self.layout = layout
        muon, adamw = [], []
        for name, param in layout.named_local_parameters():
            if not param.requires_grad:
                continue
            shape = layout.spec(name).shape
            use_muon = algorithm == "muon" and orthogonalised(name, shape)
            (muon if use_muon else adamw).append((name, param))
        groups = [
            {"params": [p for _, p in ps], "names": [n for n, _ in ps], "use_muon": use}
            for ps, use in ((muon, True), (adamw, False))
            if ps
        ]
        defaults = muon_adamw_defaults(**hyperparameters)
        super().__init__(groups, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                self._init_state(param, group["use_muon"])

    def _init_state(self, param: torch.Tensor, use_muon: bool) -> None:
        state = self.state[param]
        if use_muon:
            state["momentum_buffer"] = torch.zeros_like(param)
            return
        state.update(adamw_state(param))

    def named_parameters(self) -> list[tuple[str, torch.Tensor, dict]]:
        """(name, local parameter, its group) for every parameter this optimizer steps."""
        return [
            (name, param, group)
            for group in self.param_groups
            for name, param in zip(group["names"], group["params"], strict=True)
        ]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self.layout.finish_gradients()  # a no-op when clipping already did it
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                stepped = [p for p in group["params"] if p.grad is not None]
                states = [self.state[p] for p in stepped]
                adamw_update_any_split(stepped, states, **adamw_keywords(group))
        return loss

    def _muon_step(self, group: dict) -> None:
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param in group["params"]:
            if param.grad is None or param.numel() == 0:
                continue
            buffer = self.state[param]["momentum_buffer"]
            nesterov = nesterov_momentum(param, buffer, group["momentum"])
            batches.setdefault((tuple(param.shape[1:]), param.dtype), []).append((param, nesterov))
        for items in batches.values():
            stacked = torch.cat([nesterov for _, nesterov in items])
            updates = orthogonalise(stacked, group["ns_steps"]).split(
                [param.shape[0] for param, _ in items]
            )
            for (param, _), update in zip(items, updates, strict=True):
                apply_muon_update(param, update, group)
