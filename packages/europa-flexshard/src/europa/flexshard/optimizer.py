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

import torch

from europa.flexshard.layout import FlexShardLayout
from europa.spec.muon import (
    adamw_state,
    adamw_update_any_split,
    orthogonalise,
    rms_matching_scale,
)
from europa.spec.optim import uses_muon

__all__ = ["FlexShardOptimizer", "orthogonalise"]


class FlexShardOptimizer(torch.optim.Optimizer):
    """``algorithm="muon"``: Muon on hidden matrices (``orthogonalised(name, shape)``),
    AdamW on the rest; ``algorithm="adamw"``: AdamW on everything. State is
    created at once (zeros), so a checkpoint can be loaded before the first step."""

    def __init__(
        self,
        layout: FlexShardLayout,
        *,
        lr: float,
        algorithm: str = "muon",
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        orthogonalised: Callable[[str, Sequence[int]], bool] = uses_muon,
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
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            ns_steps=ns_steps,
            betas=betas,
            eps=eps,
        )
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.layout.finish_gradients()  # a no-op when clipping already did it
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                stepped = [p for p in group["params"] if p.grad is not None]
                adamw_update_any_split(
                    stepped,
                    [self.state[p] for p in stepped],
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
        return loss

    def _muon_step(self, group: dict) -> None:
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param in group["params"]:
            if param.grad is None or param.numel() == 0:
                continue
            buf = self.state[param]["momentum_buffer"]
            buf.lerp_(param.grad, 1 - group["momentum"])
            nesterov = param.grad.lerp(buf, group["momentum"])
            batches.setdefault((tuple(param.shape[1:]), param.dtype), []).append((param, nesterov))
        for (matrix_shape, _), items in batches.items():
            stacked = torch.cat([nesterov for _, nesterov in items])
            updates = orthogonalise(stacked, group["ns_steps"]).split(
                [param.shape[0] for param, _ in items]
            )
            scale = rms_matching_scale(matrix_shape)
            for (param, _), update in zip(items, updates, strict=True):
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"] * scale)
