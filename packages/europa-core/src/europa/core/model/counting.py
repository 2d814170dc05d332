"""Parameter counts read off a built module (meta or real), not from a formula."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torchtitan.models.common.moe import GroupedExperts, MoE


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    routed_experts: int
    active_per_token: int

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total,
            "routed_experts": self.routed_experts,
            "active_per_token": self.active_per_token,
        }


def _numel(module: nn.Module) -> int:
    # DTensor parameters report their global size through numel().
    return sum(p.numel() for p in module.parameters())


def count_parameters(model: nn.Module) -> ParameterCounts:
    """Every parameter counts toward ``total``; of the routed experts, a token
    touches ``top_k`` of ``num_experts``, so only that share is active."""
    total = _numel(model)
    routed = 0
    inactive = 0
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = [m for m in module.routed_experts.modules() if isinstance(m, GroupedExperts)]
        layer_routed = sum(_numel(m) for m in experts)
        num_experts = module.router.num_experts
        routed += layer_routed
        inactive += layer_routed * (num_experts - module.router.top_k) // num_experts
    return ParameterCounts(total=total, routed_experts=routed, active_per_token=total - inactive)
