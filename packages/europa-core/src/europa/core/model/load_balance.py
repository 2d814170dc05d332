"""Auxiliary-loss-free load balancing (Wang et al., 2024, arXiv:2408.15664).

Each MoE layer counts the tokens routed to each expert during forward. Before
the optimizer step the counts are summed over data-parallel ranks (and
micro-batches), each expert's routing bias moves by ``coeff`` toward balance,
and the counts reset. Only the *signs* of (mean - count) matter, and the
reported load is a share of the layer's routed tokens, so both are unaffected
by activation checkpointing counting the recomputed forward a second time.

torchtitan 0.3.0 has the same update only as a closure inside
``register_moe_load_balancing_hook`` (which needs its ``OptimizersContainer``
and ``ParallelDims`` and returns no loads), so it is written out here, with
the per-expert shares it computes on the way returned for ``metrics.jsonl``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.models.common.moe import MoE

from europa.spec.replicas import ReplicaGroups


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [
        (name.removesuffix(".moe"), m) for name, m in model.named_modules() if isinstance(m, MoE)
    ]


@dataclass(frozen=True)
class ExpertLoad:
    """Per MoE layer: the share of routed tokens each expert received."""

    shares: dict[str, list[float]]

    def imbalance(self) -> dict[str, float]:
        """max / mean share per layer: 1.0 is perfect balance, num_experts the worst."""
        return {
            layer: max(shares) * len(shares) if sum(shares) > 0 else 0.0
            for layer, shares in self.shares.items()
        }


def summed_counts(
    model: nn.Module, group=None, across: ReplicaGroups | None = None
) -> tuple[list[tuple[str, MoE]], torch.Tensor]:
    """Each MoE layer's tokens per expert this step, summed over the ranks of ``group``
    (default: all; under pipeline stages, the ranks holding the same layers) and averaged
    over the replica groups ``across`` (fault-tolerant runs): a collective."""
    layers = moe_layers(model)
    if not layers:
        return layers, torch.zeros(0, 0)
    counts = torch.stack([moe.tokens_per_expert_E.detach().float() for _, moe in layers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    if across is not None:
        across.average([counts])
    return layers, counts


@torch.no_grad()
def move_expert_bias(layers, counts: torch.Tensor, *, move: bool = True) -> ExpertLoad:
    """Move the biases by ``counts`` (unless the step is not taken), reset the counts."""
    totals = counts.sum(dim=1, keepdim=True).clamp_min(1.0)
    shares = counts / totals
    for (_, moe), layer_counts in zip(layers, counts, strict=True):
        if move and moe.load_balance_coeff is not None and moe.expert_bias_E is not None:
            delta = moe.load_balance_coeff * torch.sign(layer_counts.mean() - layer_counts)
            moe.expert_bias_E.add_(delta - delta.mean())
        moe.tokens_per_expert_E.zero_()
    return ExpertLoad({name: row.tolist() for (name, _), row in zip(layers, shares, strict=True)})


def update_expert_bias(model: nn.Module, group=None) -> ExpertLoad:
    """Sum this step's counts over the ranks of ``group``, move the biases, reset the
    counts.

    Call once per optimizer step on every rank (it is a collective, except in
    a model without MoE layers, where there is nothing to do)."""
    return move_expert_bias(*summed_counts(model, group))
