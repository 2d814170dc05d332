"""torchtitan 0.3.0's own Trainer alone against the same Trainer with each europa adapter
(``europa.offload.torchtitan``, ``europa.overlap.torchtitan``), on the same model, ranks
and batch, in one run.

The job is the benchmarks' torchtitan job (``_torchtitan_trainer``): the ``deepseek_v3``
debugmodel with SDPA attention, FSDP2 over the ranks (gloo, CPU), europa's ``debug``
batches, full activation checkpointing in every configuration (what europa-offload
offloads under it is each block's input). Per world size (``--worlds``, default 2 and
4) one spawned group builds every configuration's Trainer in turn, in ``--rounds``
rounds whose order alternates, so that machine drift hits all; per configuration the
median step (after ``--warmup`` steps) over all rounds, the ratio to torchtitan alone in
the same rounds, and for offload the bytes offloaded per step.

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

ADAPTERS = [None, "offload", "overlap"]


def _configurations(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every round's runs on this rank, in the round's order."""
    from _torchtitan_cpu import run_trainer  # patches torchtitan on import

    runs = []
    for round_index in range(args["rounds"]):
        order = ADAPTERS if round_index % 2 == 0 else list(reversed(ADAPTERS))
        for adapter in order:
            result = run_trainer(rank, world, {**args, "adapter": adapter})
            runs.append({"adapter": adapter or "torchtitan", "round": round_index, **result})
    return runs


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        by_name.setdefault(run["adapter"], []).append(run)
    alone = statistics.median(s for r in by_name["torchtitan"] for s in r["step_s_all"])
    summary = {}
    for name, mine in by_name.items():
        step = statistics.median(s for r in mine for s in r["step_s_all"])
        entry = {"median_step_s": round(step, 4), "over_torchtitan_alone": round(step / alone, 3)}
        if "offloaded_bytes_per_step" in mine[0]:
            entry["offloaded_bytes_per_step"] = mine[0]["offloaded_bytes_per_step"]
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
        report["worlds"][str(world)] = _summary(ranks[0])
    if options.json:
        print(json.dumps(report, indent=2))
        return
    for world, summary in report["worlds"].items():
        for name, entry in summary.items():
            print(f"{world} ranks  {name:<12} {entry}")


if __name__ == "__main__":
    main()
