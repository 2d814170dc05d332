"""FlexShard against core's FSDP2 layout with MuonWithAdamW, in one run.

For each world size, the same model (the ``debug`` preset by default), data and
Muon settings are trained for a few steps on real gloo processes, once under
core's FSDP2 layout (``MuonWithAdamW`` gathers every row-sharded matrix inside
``optimizer.step()`` and orthogonalises it on every rank) and once under
``-p flexshard`` (each rank orthogonalises only the whole matrices it owns).

Per configuration it reports, as the maximum over ranks:
  * collective payload bytes inside ``optimizer.step()`` and in a whole step,
    counted from the collectives actually issued (every ``c10d`` and functional
    collective seen by a dispatch mode; a rank's payload is the tensor it hands
    in: the local shard of an all-gather, the full input of a reduce-scatter,
    the buffer of an all-reduce), in a separate step from the timed ones;
  * median ``optimizer.step()`` time and whole-step time over the timed steps;
  * parameter + optimizer-state bytes held by each rank;
and, per world size, the ratios baseline / FlexShard and the relative
difference of the loss after the same steps.

    python benchmarks/flexshard.py [--json] [--ranks 2 4] [--steps 4] [--preset debug]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (
    CollectiveBytes,
    inside,
    local_bytes,
    print_result,
    run_ranks,
    timed,
    trainer_on_rank,
)


def _run_rank(rank: int, world: int, args: dict) -> dict:
    overrides = [
        'optimizer.name="muon"',
        f"optimizer.lr={args['lr']}",
        f"training.batch_size={args['batch_size']}",
        f"training.seq_len={args['seq_len']}",
        f"training.steps={args['steps']}",
    ]
    plugins = ["flexshard"] if args["layout"] == "flexshard" else []
    with trainer_on_rank(rank, world, args["preset"], overrides, plugins) as trainer:
        initial_equal = _initial_weights_equal_one_process(trainer, rank, args["preset"])
        optimizer_s: list[float] = []
        trainer.optimizer.step = timed(trainer.optimizer.step, optimizer_s)
        step_s, losses = [], []
        counted = {}
        for step in range(args["steps"]):
            if step == 1:  # a step of its own for counting: the dispatch mode costs time
                with CollectiveBytes() as whole:
                    in_step = CollectiveBytes()
                    plain_step = trainer.optimizer.step
                    trainer.optimizer.step = inside(in_step, plain_step)
                    record = trainer.step(step)
                    trainer.optimizer.step = plain_step
                counted = {"step": whole.bytes, "optimizer_step": in_step.bytes,
                           "optimizer_step_calls": in_step.calls}  # fmt: skip
            else:
                record = trainer.step(step)
                if step >= 2:
                    step_s.append(record["step_time_s"])
            losses.append(record["loss"])
        state = sum(
            local_bytes(v)
            for per_param in trainer.optimizer.state.values()
            for v in per_param.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        )
        params = sum(local_bytes(p) for p in trainer.model.parameters())
        return {
            "optimizer_step_s": statistics.median(optimizer_s[2:]),
            "step_s": statistics.median(step_s),
            "collective_bytes": counted,
            "parameter_and_state_bytes": params + state,
            "losses": losses,
            "initial_weights_equal_one_process": initial_equal,
        }


def _initial_weights_equal_one_process(trainer, rank: int, preset: str) -> bool | None:
    """Gather the initial weights (a collective) and, on rank 0, compare them bit for
    bit with a single-process initialisation of the same model."""
    from europa.core.model import build_moe_model, materialise

    layout = trainer.job.state.get("flexshard")
    if layout is not None:
        full = layout.full_parameters()
    else:
        full = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
    if rank != 0:
        return None
    reference = build_moe_model(trainer.job.config.model)
    materialise(reference, torch.device("cpu"), trainer.job.config.run.seed)
    return all(torch.equal(full[n], p.detach()) for n, p in reference.named_parameters())


def summarise(layout: str, world: int, per_rank: list[dict]) -> dict:
    return {
        "layout": layout,
        "ranks": world,
        "optimizer_step_collective_bytes": max(
            r["collective_bytes"]["optimizer_step"] for r in per_rank
        ),
        "optimizer_step_collective_calls": max(
            r["collective_bytes"]["optimizer_step_calls"] for r in per_rank
        ),
        "step_collective_bytes": max(r["collective_bytes"]["step"] for r in per_rank),
        "optimizer_step_s": max(r["optimizer_step_s"] for r in per_rank),
        "step_s": max(r["step_s"] for r in per_rank),
        "parameter_and_state_bytes_per_rank": [r["parameter_and_state_bytes"] for r in per_rank],
        "losses": per_rank[0]["losses"],
        "initial_weights_equal_one_process": per_rank[0]["initial_weights_equal_one_process"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="1 warm-up, 1 counted, rest timed")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (warm-up, counted, timed)")

    configs, comparisons = [], []
    for world in args.ranks:
        by_layout = {}
        for layout in ("fsdp2", "flexshard"):
            run_args = vars(args) | {"layout": layout}
            by_layout[layout] = summarise(layout, world, run_ranks(_run_rank, world, run_args))
            configs.append(by_layout[layout])
            if not args.json:
                print(json.dumps(by_layout[layout]), file=sys.stderr)
        base, flex = by_layout["fsdp2"], by_layout["flexshard"]
        comparisons.append(
            {
                "ranks": world,
                "optimizer_step_time_ratio_fsdp2_over_flexshard": base["optimizer_step_s"]
                / flex["optimizer_step_s"],
                "step_time_ratio_fsdp2_over_flexshard": base["step_s"] / flex["step_s"],
                "optimizer_step_collective_bytes": {
                    "fsdp2": base["optimizer_step_collective_bytes"],
                    "flexshard": flex["optimizer_step_collective_bytes"],
                },
                "step_collective_bytes_ratio_fsdp2_over_flexshard": base["step_collective_bytes"]
                / flex["step_collective_bytes"],
                "max_parameter_and_state_bytes_ratio_fsdp2_over_flexshard": max(
                    base["parameter_and_state_bytes_per_rank"]
                )
                / max(flex["parameter_and_state_bytes_per_rank"]),
                "final_loss_relative_difference": abs(flex["losses"][-1] - base["losses"][-1])
                / abs(base["losses"][-1]),
            }
        )
    print_result("flexshard", args, configs, comparisons, optimizer="muon")


if __name__ == "__main__":
    main()
