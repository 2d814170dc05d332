"""CPU causal attention at a preset's MLA shapes: ``BlockCausalAttention`` (what CPU runs
use) at several chunk counts against SDPA, forward + backward of one layer.

SDPA's reference ("math") path is what CPU runs used before, and is the baseline; its
flash kernel needs value heads as wide as query heads, so it runs with v zero-padded to
the query width (the output cut back). All variants run in the same process,
alternating, on the same tensors. Also the work's lower bound: the causal half of the
attention FLOPs at the fp32 ``torch.mm`` peak measured here at a matching shape. Prints
one JSON object; ``over_sdpa_math`` > 1 means faster than the baseline.

``softmax_backward`` times the softmax backward of the second of 4 blocks' probabilities
both ways, alternating: the composite formula ``P * (dP - rowsum(P * dP))`` (three
temporaries) against torch's fused ``_softmax_backward_data`` (one pass), which
``BlockCausalAttention`` uses. ``fused_over_composite`` > 1 means the fused one is faster.

    python benchmarks/attention.py [--preset debug] [--batch 4] [--seq-len 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from europa.core.config import load_config
from europa.core.model.attention import BlockCausalAttention

CHUNKS = (1, 2, 4, 8)


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def _softmax_backward(shape: tuple[int, int, int], repeats: int) -> dict:
    probs = torch.randn(shape).softmax(-1)
    grad = torch.randn(shape)
    variants = {
        "composite": lambda: probs * (grad - (probs * grad).sum(-1, keepdim=True)),
        "fused": lambda: torch._softmax_backward_data(grad, probs, -1, probs.dtype),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name] += _timed(fn, 1)
    medians = {name: statistics.median(t) for name, t in times.items()}
    difference = (variants["fused"]() - variants["composite"]()).abs().max().item()
    return {
        "shape": list(shape),
        "median_s": medians,
        "fused_over_composite": medians["composite"] / medians["fused"],
        "max_abs_difference": difference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    m = load_config(args.preset).model
    heads, qk = m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    torch.manual_seed(0)

    def leaf(width: int) -> torch.Tensor:  # (B, L, N, H), as torchtitan's attention passes
        return torch.randn(args.batch, args.seq_len, heads, width, requires_grad=True)

    q, k, v = leaf(qk), leaf(qk), leaf(m.v_head_dim)
    grad = torch.randn(args.batch, args.seq_len, heads, m.v_head_dim)

    def block_causal(chunks: int):
        attention = BlockCausalAttention(BlockCausalAttention.Config(chunks=chunks))
        return lambda: attention(q, k, v).backward(grad)

    def sdpa(pad_v: bool):
        def run():
            by_head = [t.transpose(1, 2) for t in (q, k, v)]
            if pad_v:  # flash: v as wide as q
                by_head[2] = F.pad(by_head[2], (0, qk - m.v_head_dim))
            out = F.scaled_dot_product_attention(*by_head, is_causal=True)
            out[..., : m.v_head_dim].transpose(1, 2).backward(grad)

        return run

    variants = {"sdpa_math": sdpa(False), "sdpa_flash_padded_v": sdpa(True)}
    variants |= {f"block_causal_{c}_chunks": block_causal(c) for c in CHUNKS}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # alternating, so noise hits every variant
        for name, fn in variants.items():
            times[name] += _timed(fn, 1)
    medians = {name: statistics.median(t) for name, t in times.items()}

    rows = args.batch * heads * args.seq_len
    a, b = torch.randn(rows // heads, qk), torch.randn(qk, args.seq_len)
    mm_s = min(_timed(lambda: torch.mm(a, b), 20))
    peak = 2 * a.shape[0] * qk * args.seq_len / mm_s
    pairs = args.batch * heads * args.seq_len * (args.seq_len + 1) / 2  # causal (q, k) pairs
    flops = 3 * 2 * pairs * (qk + m.v_head_dim)  # forward + backward (2x forward)
    print(json.dumps({
        "benchmark": "attention",
        "preset": args.preset,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "heads": heads,
        "qk_head_dim": qk,
        "v_head_dim": m.v_head_dim,
        "threads": torch.get_num_threads(),
        "median_s": medians,
        "over_sdpa_math": {n: medians["sdpa_math"] / s for n, s in medians.items()},
        "causal_flops": flops,
        "fp32_mm_flops_per_s": peak,
        "lower_bound_s": flops / peak,
        "softmax_backward": _softmax_backward(  # the second of 4 blocks: 1/4 of the queries
            (args.batch * heads, args.seq_len // 4, args.seq_len // 2), 4 * args.repeats
        ),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
