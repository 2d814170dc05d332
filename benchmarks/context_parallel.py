"""Context parallelism for MLA: what each exchange sends, and a step at cp = 2 against
cp = 1 at the same global batch, in one run.

1. **Bytes** (arithmetic, ``europa.core.plan.context``): a token's numbers per MLA layer in
   each exchange at the ``kimi-k2`` head shape, the latent (kv_lora_rank + the rotary key)
   against every head's keys and values, and their ratio.
2. **Steps** (two spawned gloo ranks, ``--preset`` ``debug`` at ``--seq-len`` 1024, with
   ``--heads`` 64: debug's head dims are Kimi-K2's, so its exchanges are Kimi-K2's): the
   same global batch three ways: cp = 1 (each rank reads ``--batch-size`` sequences), and
   cp = 2 with each exchange (the two ranks read twice that and cut each sequence in two).
   For each: the median step time over ``--steps`` steps after ``--warmup``, the bytes a
   step sent in the exchanges (``cp_sent_bytes``, counted) and the planner's, per layer
   and pass, and the losses (the three must agree).

    python benchmarks/context_parallel.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import run_ranks, trainer_on_rank


def _overrides(args: dict, cp: int, exchange: str) -> list[str]:
    return [
        f"model.n_heads={args['heads']}",
        f"training.seq_len={args['seq_len']}",
        f"model.max_seq_len={args['seq_len']}",
        f"training.batch_size={args['batch_size'] * cp}",
        f"training.steps={args['warmup'] + args['steps']}",
        "checkpoint.every=0",
        f"parallel.cp={cp}",
        f'parallel.cp_exchange="{exchange}"',
    ]


def _steps(rank: int, world: int, args: dict) -> dict:
    from europa.core.plan.context import exchange_bytes_per_pass

    overrides = _overrides(args, args["cp"], args["exchange"])
    with trainer_on_rank(rank, world, args["preset"], overrides, []) as trainer:
        times, losses, sent = [], [], []
        for step in range(args["warmup"] + args["steps"]):
            started = time.perf_counter()
            record = trainer.step(step)
            if step >= args["warmup"]:
                times.append(time.perf_counter() - started)
            losses.append(record["loss"])
            sent.append(record.get("cp_sent_bytes", 0))
        config = trainer.job.config
        layers = config.model.n_layers
        return {
            "step_s": statistics.median(times),
            "losses": losses,
            "sent_bytes_per_step": statistics.median(sent),
            "gather_bytes_per_layer": statistics.median(sent) / 2 / layers,
            "planned_gather_bytes_per_layer": exchange_bytes_per_pass(config, layers) / layers,
        }


def _bytes_per_token() -> dict:
    from europa.core.config import load_config
    from europa.core.plan.context import exchange_width

    m = load_config("kimi-k2").model
    latent, kv = exchange_width(m, "latent"), exchange_width(m, "kv")
    return {"latent": latent, "kv": kv, "kv_over_latent": kv / latent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences a rank at cp = 1")
    heads = "attention heads: 64 with debug's head dims is Kimi-K2's head shape"
    parser.add_argument("--heads", type=int, default=64, help=heads)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    common = {"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "warmup": args.warmup, "steps": args.steps, "heads": args.heads}  # fmt: skip
    runs = {
        name: run_ranks(_steps, 2, {**common, "cp": cp, "exchange": exchange})[0]
        for name, cp, exchange in (
            ("cp1", 1, "latent"),
            ("cp2_latent", 2, "latent"),
            ("cp2_kv", 2, "kv"),
        )
    }
    reference = runs["cp1"]["losses"]
    result = {
        "benchmark": "context_parallel",
        "preset": args.preset,
        "seq_len": args.seq_len,
        "global_batch_sequences": 2 * args.batch_size,
        "steps": args.steps,
        "torch": torch.__version__,
        "kimi_k2_numbers_per_token_per_layer": _bytes_per_token(),
        "runs": {
            name: {k: v for k, v in run.items() if k != "losses"} for name, run in runs.items()
        },
        "cp2_over_cp1_step_time": {
            name: runs[name]["step_s"] / runs["cp1"]["step_s"] for name in ("cp2_latent", "cp2_kv")
        },
        "kv_over_latent_bytes": runs["cp2_kv"]["sent_bytes_per_step"]
        / runs["cp2_latent"]["sent_bytes_per_step"],
        "largest_loss_difference_from_cp1": {
            name: max(
                abs(a - b) / abs(b) for a, b in zip(runs[name]["losses"], reference, strict=True)
            )
            for name in ("cp2_latent", "cp2_kv")
        },
    }
    print(json.dumps(result, indent=2))
    if not args.json:
        ratios = result["cp2_over_cp1_step_time"]
        print(f"cp=2 step time over cp=1: latent {ratios['cp2_latent']:.3f}, "
              f"kv {ratios['cp2_kv']:.3f}; kv sends {result['kv_over_latent_bytes']:.1f}x "
              "the latent's bytes")  # fmt: skip


if __name__ == "__main__":
    main()
