"""QK-clip (MuonClip) at work, its step-time cost and its traffic, in one run.

Three parts, each on fresh spawned gloo ranks:

1. **Growth** (one rank, ``--preset`` ``tiny`` at Muon's ``--lr``): the same training twice,
   once recording the logits without clipping (tau = 1e9) and once with the clip at
   ``--tau``. With the clip, after each step the step's own sequences are run forward
   again and their largest logit read. JSON: each run's largest logit by step (before the
   clip), the clipped run's largest logit after each step's clip, and the final loss (the
   mean of the last ``--final`` steps' losses, as one step's loss is one batch's).
   The clip (Kimi-K2's Algorithm 1) takes the maxima of the step's forward, before the
   optimizer's update, and scales the updated weights: the same sequences' logits after
   the clip are tau × (their maximum after the update) / (their maximum before it), so
   they can exceed tau by what one update moved them; ``largest_after_clip_over_tau``
   says by how much at this learning rate.
2. **Cost** (one rank, ``--cost-preset`` ``debug``): one trainer whose steps alternate with
   the clip on (tau 1e-3: every head clips every step, the most work it can do) and off
   (recording disarmed, no reduce, no scaling); the median step time of each and their
   ratio.
3. **Traffic** (two ranks, FlexShard, tau 1e-3): the bytes handed to collectives inside
   ``optimizer.step()``, inside the maxima's reduce, and inside the rows' scaling, counted
   at the dispatcher: the step sends 0 bytes, the reduce is the only new traffic.

    python benchmarks/qk_clip.py --json
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
from _harness import CollectiveBytes, inside, run_ranks, trainer_on_rank

RECORD_ONLY_TAU = 1e9


def _overrides(args: dict, tau: float) -> list[str]:
    return [
        'optimizer.name="muon"',
        f"optimizer.lr={args['lr']}",
        "optimizer.qk_clip=true",
        f"optimizer.qk_clip_tau={tau}",
        f"training.batch_size={args['batch_size']}",
        f"training.steps={args['steps']}",
        "checkpoint.every=100000",
    ]


def _largest_now(trainer, step: int) -> float:
    """The step's own sequences forward again, in training mode: their largest logit."""
    recorders = [recorder for recorder, _, _ in trainer.qk_clip.layers.values()]
    accum = trainer.job.config.training.grad_accum_steps
    with torch.enable_grad():
        for micro in range(accum):
            inputs, _ = trainer.batches.source.batch(step, micro)
            trainer.model(inputs.to(trainer.job.device))
    largest = max(float(r.read().max()) for r in recorders)
    for recorder in recorders:
        recorder.reset()
    return largest


def _growth(rank: int, world: int, args: dict) -> dict:
    with trainer_on_rank(rank, world, args["preset"], _overrides(args, args["tau"]), []) as t:
        clipping = args["tau"] < RECORD_ONLY_TAU
        losses, before, after, clipped = [], [], [], []
        for step in range(args["steps"]):
            record = t.step(step)
            losses.append(record["loss"])
            before.append(max(record["qk_logit_max"].values()))
            clipped.append(record["qk_heads_clipped"])
            if clipping:
                after.append(_largest_now(t, step))
        return {"losses": losses, "largest_logit": before, "largest_logit_after_clip": after,
                "heads_clipped": clipped}  # fmt: skip


def _cost(rank: int, world: int, args: dict) -> dict:
    overrides = [*_overrides(args, 1e-3)[:4], f"training.steps={2 * args['cost_steps'] + 2}"]
    with trainer_on_rank(rank, world, args["cost_preset"], overrides, []) as t:
        clip = t.qk_clip
        armed = [(m, m.logit_max) for m in t.model.modules() if getattr(m, "logit_max", None)]
        times: dict[bool, list[float]] = {True: [], False: []}
        clipped = []
        for step in range(2 * args["cost_steps"] + 2):
            on = step % 2 == 0  # off: no recording, no reduce, no scaling
            t.qk_clip = clip if on else None
            for module, recorder in armed:
                module.logit_max = recorder if on else None
            started = time.perf_counter()
            record = t.step(step)
            if step >= 2:  # the first of each: allocations, caches
                times[on].append(time.perf_counter() - started)
            if on:
                clipped.append(record["qk_heads_clipped"])
        return {"with_clip_s": statistics.median(times[True]),
                "without_s": statistics.median(times[False]),
                "heads_clipped_per_step": statistics.median(clipped)}  # fmt: skip


def _traffic(rank: int, world: int, args: dict) -> dict:
    overrides = [*_overrides(args, 1e-3)[:4], "training.steps=3", "parallel.ep=2"]
    with trainer_on_rank(rank, world, "tiny", overrides, ["flexshard"]) as t:
        t.step(0)
        counts = {name: CollectiveBytes() for name in ("optimizer_step", "reduce", "scaling")}
        t.optimizer.step = inside(counts["optimizer_step"], t.optimizer.step)
        t.qk_clip.agreed_maxima = inside(counts["reduce"], t.qk_clip.agreed_maxima)
        t._clip_heads = inside(counts["scaling"], t._clip_heads)
        record = t.step(1)
        layers, heads = t.job.config.model.n_layers, t.job.config.model.n_heads
        return {
            **{f"{name}_bytes": c.bytes for name, c in counts.items()},
            "reduce_calls": counts["reduce"].calls,
            "maxima_bytes": layers * heads * 4,
            "heads_clipped": record["qk_heads_clipped"],
        }


def _final(losses: list[float], last: int) -> float:
    return statistics.fmean(losses[-last:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lr", type=float, default=0.05, help="Muon's learning rate")
    parser.add_argument("--tau", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--final", type=int, default=20, help="steps the final loss averages")
    parser.add_argument("--cost-preset", default="debug")
    parser.add_argument("--cost-steps", type=int, default=10, help="timed steps each way")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    common = {"preset": args.preset, "lr": args.lr, "steps": args.steps,
              "batch_size": args.batch_size, "cost_preset": args.cost_preset,
              "cost_steps": args.cost_steps}  # fmt: skip
    unclipped = run_ranks(_growth, 1, {**common, "tau": RECORD_ONLY_TAU})[0]
    clipped = run_ranks(_growth, 1, {**common, "tau": args.tau})[0]
    cost = run_ranks(_cost, 1, {**common, "batch_size": 4})[0]
    traffic = run_ranks(_traffic, 2, {**common, "batch_size": 2})
    final_without = _final(unclipped["losses"], args.final)
    final_with = _final(clipped["losses"], args.final)
    result = {
        "benchmark": "qk_clip",
        "preset": args.preset,
        "lr": args.lr,
        "tau": args.tau,
        "steps": args.steps,
        "torch": torch.__version__,
        "growth": {
            "largest_logit_without_clip": max(unclipped["largest_logit"]),
            "steps_past_tau_without_clip": sum(v > args.tau for v in unclipped["largest_logit"]),
            "largest_logit_after_clip": max(clipped["largest_logit_after_clip"]),
            "after_clip_at_most_tau": max(clipped["largest_logit_after_clip"])
            <= args.tau * (1 + 1e-5),
            "largest_after_clip_over_tau": max(clipped["largest_logit_after_clip"]) / args.tau,
            "steps_after_clip_over_tau": sum(
                v > args.tau * (1 + 1e-5) for v in clipped["largest_logit_after_clip"]
            ),
            "steps_clipping": sum(c > 0 for c in clipped["heads_clipped"]),
            "final_loss_without_clip": final_without,
            "final_loss_with_clip": final_with,
            "final_loss_ratio": final_with / final_without,
            "final_loss_over": f"the mean of the last {args.final} steps' losses",
            "largest_logit_by_step": {
                "without_clip": unclipped["largest_logit"],
                "with_clip_before": clipped["largest_logit"],
                "with_clip_after": clipped["largest_logit_after_clip"],
            },
        },
        "cost": {
            "preset": args.cost_preset,
            **cost,
            "ratio": cost["with_clip_s"] / cost["without_s"],
        },
        "flexshard_traffic": {"ranks": 2, "per_rank": traffic},
    }
    print(json.dumps(result, indent=2))
    if not args.json:
        g = result["growth"]
        print(f"without the clip the largest logit reached {g['largest_logit_without_clip']:.1f} "
              f"(tau {args.tau}); with it, after each step's clip, at most "
              f"{g['largest_logit_after_clip']:.3f}; final loss ratio {g['final_loss_ratio']:.4f}; "
              f"step time ratio {result['cost']['ratio']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
