"""Routed experts in fp32 (EUROPA's CPU path) against torchtitan's bf16-cast path.

Both run forward + backward of one MoE layer's routed experts on the same
tokens, in the same process, alternating, so machine noise hits both. Also
times Muon's Newton–Schulz orthogonalisation in fp32 (ours) against bf16
(torch.optim.Muon's). Prints one JSON object; ratios > 1 mean the baseline
(bf16) is slower.

    python benchmarks/expert_dtype.py [--preset debug] [--tokens 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from torchtitan.models.common.moe import GroupedExperts

from europa.core.config import load_config
from europa.core.model.experts import NativeDtypeGroupedExperts
from europa.core.optim.muon import NS_COEFFICIENTS, orthogonalise


def _experts(cls, m) -> torch.nn.Module:
    torch.manual_seed(0)
    experts = cls.Config(dim=m.dim, hidden_dim=m.moe_hidden_dim, num_experts=m.num_experts).build()
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.02)
    return experts


def _fwd_bwd(experts: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor) -> None:
    experts.zero_grad(set_to_none=True)
    experts(x, counts).square().mean().backward()


def _time(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--tokens", type=int, default=1024, help="routed tokens (T × top_k)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    m = load_config(args.preset).model
    counts = torch.full((m.num_experts,), args.tokens // m.num_experts)
    x = torch.randn(int(counts.sum()), m.dim, requires_grad=True)
    ours, baseline = _experts(NativeDtypeGroupedExperts, m), _experts(GroupedExperts, m)
    fp32_s, bf16_s = [], []
    for _ in range(args.repeats):
        fp32_s += _time(lambda: _fwd_bwd(ours, x, counts), 1)
        bf16_s += _time(lambda: _fwd_bwd(baseline, x, counts), 1)

    matrix = torch.randn(m.dim, m.moe_hidden_dim)
    ns_fp32 = _time(lambda: orthogonalise(matrix), args.repeats)
    ns_bf16 = _time(
        lambda: _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, 5, 1e-7), args.repeats
    )

    fp32, bf16 = statistics.median(fp32_s), statistics.median(bf16_s)
    print(
        json.dumps(
            {
                "benchmark": "expert_dtype",
                "preset": args.preset,
                "threads": torch.get_num_threads(),
                "routed_tokens": int(counts.sum()),
                "experts_fwd_bwd_s": {"fp32_native": fp32, "bf16_cast_baseline": bf16},
                "experts_speedup_vs_baseline": bf16 / fp32,
                "newton_schulz_s": {
                    "fp32": statistics.median(ns_fp32),
                    "bf16_baseline": statistics.median(ns_bf16),
                },
                "newton_schulz_speedup_vs_baseline": statistics.median(ns_bf16)
                / statistics.median(ns_fp32),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
