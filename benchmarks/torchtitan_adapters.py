"""torchtitan 0.3.0's own Trainer alone against the same Trainer with each europa adapter
(``europa.offload.torchtitan``, ``europa.overlap.torchtitan``, and at 4 ranks
``europa.flexshard.torchtitan`` against torchtitan's FSDP2 + expert parallelism), on the
same model, ranks and batch, in one run.

The job is the benchmarks' torchtitan job (``_torchtitan_trainer``): the ``deepseek_v3``
debugmodel with SDPA attention, FSDP2 over the ranks (gloo, CPU), europa's ``debug``
batches, full activation checkpointing in every configuration (what europa-offload
offloads under it is each block's input). Per world size (``--worlds``, default 2 and
4) one spawned group builds every configuration's Trainer in turn, in ``--rounds``
rounds whose order alternates, so that machine drift hits all; per configuration the
median step (after ``--warmup`` steps) over all rounds, the ratio to its baseline in the
same run, and for offload the bytes offloaded per step. At 4 ranks, torchtitan with
``ep`` = 4 and europa-flexshard with ``ep`` = 4 as two emulated nodes of 2 ranks (its
exchange two-level; both with node-limited routing to one node, a plain loss), with the
optimizer step's median time and the collectives and bytes counted inside it over the
whole run (gloo on loopback: the nodes' link is not throttled here).

    python benchmarks/torchtitan_adapters.py [--json] [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import run_ranks

# name -> (the run's settings, the configuration it is compared with)
ADAPTERS = {
    "torchtitan": ({}, "torchtitan"),
    "offload": ({"adapter": "offload"}, "torchtitan"),
    "overlap": ({"adapter": "overlap"}, "torchtitan"),
}
# ep = 4 over two emulated nodes of 2 ranks, a token's experts on one node (both runs)
EXPERT_PARALLEL = {"ep": 4, "nodes": 2, "plain_loss": True, "count_step_traffic": True}
FLEXSHARD = {
    "torchtitan-ep4": (EXPERT_PARALLEL, "torchtitan-ep4"),
    "flexshard-ep4": ({**EXPERT_PARALLEL, "adapter": "flexshard"}, "torchtitan-ep4"),
}


def _names(world: int) -> dict[str, tuple[dict, str]]:
    return {**ADAPTERS, **(FLEXSHARD if world == 4 else {})}


def _configurations(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every round's runs on this rank, in the round's order."""
    from _torchtitan_cpu import run_trainer  # patches torchtitan on import

    runs = []
    names = list(_names(world))
    for round_index in range(args["rounds"]):
        for name in names if round_index % 2 == 0 else reversed(names):
            settings, _ = _names(world)[name]
            result = run_trainer(rank, world, {**args, **settings})
            runs.append({"name": name, "round": round_index, **result})
    return runs


def _summary(world: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)

    def median(name: str, of) -> float:
        return statistics.median(value for run in by_name[name] for value in of(run))

    summary = {}
    for name, (_, baseline) in _names(world).items():
        step = median(name, lambda r: r["step_s_all"])
        entry = {
            "median_step_s": round(step, 4),
            f"over_{baseline}": round(step / median(baseline, lambda r: r["step_s_all"]), 3),
        }
        first = by_name[name][0]
        if "offloaded_bytes_per_step" in first:
            entry["offloaded_bytes_per_step"] = first["offloaded_bytes_per_step"]
        if "optimizer_step_bytes" in first:
            optimizer = median(name, lambda r: [r["phases_s"]["optimizer"]])
            entry["optimizer_step_s"] = round(optimizer, 4)
            entry["optimizer_step_calls"] = first["optimizer_step_calls"]
            entry["optimizer_step_bytes"] = first["optimizer_step_bytes"]
        summary[name] = entry
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    import tempfile

    data_dir = tempfile.mkdtemp(prefix="torchtitan-adapters-")
    report: dict[str, Any] = {
        "benchmark": "torchtitan_adapters",
        "cpu_count": os.cpu_count(),
        "job": "deepseek_v3 debugmodel, FSDP2, full activation checkpointing, debug batches",
        "worlds": {},
    }
    for world in options.worlds:
        args = {"preset": "debug", "overrides": [], "fp32_experts": False, "log_every": 1,
                "data_dir": data_dir, "steps": options.steps, "full_ac": True,
                "warmup": options.warmup, "timed": options.steps - options.warmup,
                "profiled": 0, "rounds": options.rounds}  # fmt: skip
        ranks = run_ranks(_configurations, world, args)
        report["worlds"][str(world)] = _summary(world, ranks[0])
    if options.json:
        print(json.dumps(report, indent=2))
        return
    for world, summary in report["worlds"].items():
        for name, entry in summary.items():
            print(f"{world} ranks  {name:<12} {entry}")


if __name__ == "__main__":
    main()
