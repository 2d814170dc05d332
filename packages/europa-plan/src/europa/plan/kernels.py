"""How long one kernel takes on one GPU: a roofline of the precision's peak and the HBM's
bandwidth, with what keeps a real kernel below it.

* **Matrix multiplies** (m × k by k × n): the GPU computes its output in 128 × 128 tiles,
  one a streaming multiprocessor (SM) at a time. A multiply whose tiles do not fill the
  last wave leaves SMs idle: with T tiles on S SMs it runs at T / (⌈T/S⌉·S) of its
  rate. Small multiplies (few tiles) lose most. On top, the generation's fitted GEMM
  efficiency for the precision, and for the experts' grouped multiplies (per-expert
  blocks, smaller, launched together) its fitted share of it. A multiply reads its
  operands and writes its output at least once: it takes no less than those bytes over
  the HBM bandwidth.
* **Attention** (FlashAttention): its FLOPs over the bf16 peak at the generation's
  attention efficiency (attention runs in bf16 under every recipe here).
* **Memory-bound work** (norms, activations, rotary, the router, permutations, casts,
  the optimizer step): bytes moved over the HBM bandwidth at the memory efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TILE = 128


@dataclass(frozen=True)
class Gemm:
    """A matrix multiply: (m × k) by (k × n), ``count`` times."""

    m: float
    n: float
    k: float
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.count

    def passes(self) -> tuple[Gemm, Gemm, Gemm]:
        """Forward, the input's gradient (m × n by n × k) and the weight's (k × m by m × n)."""
        return (
            self,
            Gemm(self.m, self.k, self.n, self.count),
            Gemm(self.k, self.n, self.m, self.count),
        )


def wave_efficiency(m: float, n: float, sms: int) -> float:
    """The share of the SMs a multiply's output tiles keep busy, over its waves."""
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_seconds(
    gemm: Gemm, peak_tflops: float, efficiency: float, hbm_tbps: float, sms: int, in_bytes: float
) -> float:
    """One multiply (times its count): the slower of its compute and its memory traffic."""
    if gemm.m <= 0 or gemm.n <= 0 or gemm.k <= 0:
        return 0.0
    rate = peak_tflops * 1e12 * efficiency * wave_efficiency(gemm.m, gemm.n, sms)
    compute = 2 * gemm.m * gemm.n * gemm.k / rate
    traffic = (gemm.m * gemm.k + gemm.k * gemm.n) * in_bytes + gemm.m * gemm.n * 2
    return max(compute, traffic / (hbm_tbps * 1e12)) * gemm.count


def flops_seconds(flops: float, peak_tflops: float, efficiency: float) -> float:
    return flops / (peak_tflops * 1e12 * efficiency)


def bytes_seconds(moved: float, hbm_tbps: float, efficiency: float) -> float:
    return moved / (hbm_tbps * 1e12 * efficiency)
