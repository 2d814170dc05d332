"""Routed experts that compute in their own parameter dtype.

torchtitan's ``GroupedExperts`` casts activations and weights to bf16 for
``torch._grouped_mm``, which is right for Hopper. In an fp32 run that cast
silently turns most of an MoE's FLOPs into bf16: results differ from the rest
of the fp32 model, and exactness checks (resume, recomputation, accumulation)
would not hold. Whether it is faster depends on the CPU's bf16 units;
``benchmarks/expert_dtype.py`` measures both paths on the machine at hand.
This subclass keeps the same parameters (names, shapes, init) and the same
grouped matmul, minus the cast, so checkpoints are interchangeable; bf16 runs
(``training.dtype = "bfloat16"``) keep torchtitan's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class NativeDtypeGroupedExperts(GroupedExperts):
    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

        def grouped(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return self._grouped_mm(A=a, B_t=_local(weight).transpose(-2, -1), offs=offsets_E)

        hidden_RF = F.silu(grouped(x_RD, self.w1_EFD)) * grouped(x_RD, self.w3_EFD)
        return grouped(hidden_RF, self.w2_EDF)
