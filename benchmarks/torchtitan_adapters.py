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
whole run (gloo on loopback).

Then the same two ``ep`` = 4 runs on a throttled two-node link: ranks 0 and 1 in one
network namespace, 2 and 3 in another, joined by a veth pair rate-limited with ``tc tbf``
(``_netns``; ``--rate-mbit``), each rank a process of its own started in its node's
namespace, with, besides the step and optimizer figures, the bytes a node sends over
the link in a step (the veth's counter: every collective, the expert exchange, FSDP2's or
flexshard's parameter and gradient traffic alike). Needs root for ``ip netns`` and
``tc``: without them the benchmark stops before it starts and says why, unless
``--rate-mbit 0`` leaves this phase out.

    python benchmarks/torchtitan_adapters.py [--json] [--steps 6] [--rounds 2] [--rate-mbit 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import first_failure, run_ranks, write_gathered
from _netns import TwoNodes, emulated_link, teardown

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


# the throttled link's two nodes of 2 ranks (the ep = 4 runs' emulated nodes)
LINK_NODES = TwoNodes(("europa-ta0", "europa-ta1"), ("10.234.0.1", "10.234.0.2"))
LINK_RANKS, LINK_PER_NODE, LINK_PORT = 4, 2, 29791


def _names(world: int, link: bool = False) -> dict[str, tuple[dict, str]]:
    if link:
        return FLEXSHARD
    return {**ADAPTERS, **(FLEXSHARD if world == 4 else {})}


def _configurations(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every round's runs on this rank, in the round's order."""
    from _torchtitan_cpu import run_trainer  # patches torchtitan on import

    runs = []
    table = _names(world, args.get("link_device") is not None)
    names = list(table)
    for round_index in range(args["rounds"]):
        for name in names if round_index % 2 == 0 else reversed(names):
            settings, _ = table[name]
            result = run_trainer(rank, world, {**args, **settings})
            runs.append({"name": name, "round": round_index, **result})
    return runs


def _summary(world: int, runs: list[dict[str, Any]], link: bool = False) -> dict[str, Any]:
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)

    def median(name: str, of) -> float:
        return statistics.median(value for run in by_name[name] for value in of(run))

    summary = {}
    for name, (_, baseline) in _names(world, link).items():
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
        if "link_sent_bytes_per_step" in first:
            entry["link_sent_bytes_per_step_per_node"] = statistics.median(
                run["link_sent_bytes_per_step"] for run in by_name[name]
            )
        summary[name] = entry
    return summary


def _job(options: argparse.Namespace, data_dir: str) -> dict[str, Any]:
    return {"preset": "debug", "overrides": [], "fp32_experts": False, "log_every": 1,
            "data_dir": data_dir, "steps": options.steps, "full_ac": True,
            "warmup": options.warmup, "timed": options.steps - options.warmup,
            "profiled": 0, "rounds": options.rounds}  # fmt: skip


def _link_worker(options: argparse.Namespace) -> None:
    """One rank of the throttled-link phase, started inside its node's namespace."""
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out = Path(options.out)
    device = LINK_NODES.devices[rank // LINK_PER_NODE]
    runs = _configurations(rank, world, {**_job(options, str(out / "data")), "link_device": device})
    write_gathered(out / "link.json", runs)


def _over_link(options: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The ep = 4 runs, each rank a process in its node's namespace; their summary."""
    procs, logs = [], []
    for rank in range(LINK_RANKS):
        node = rank // LINK_PER_NODE
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(LINK_RANKS),
                   MASTER_PORT=str(LINK_PORT), **LINK_NODES.environment(node))  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "--out", str(out),
               "--steps", str(options.steps), "--warmup", str(options.warmup),
               "--rounds", str(options.rounds)]  # fmt: skip
        logs.append(out / f"link-rank{rank}.log")
        with logs[-1].open("w") as log:  # the rank's process holds its own copy
            procs.append(
                subprocess.Popen(LINK_NODES.command(node, cmd), env=env, stdout=log, stderr=log)
            )
    failed = first_failure(procs, logs)
    if failed:
        raise SystemExit(f"torchtitan_adapters benchmark: the throttled-link phase: {failed}")
    ranks = json.loads((out / "link.json").read_text())
    return _summary(LINK_RANKS, ranks[0], link=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="the nodes' link each way; 0: no throttled-link phase")  # fmt: skip
    parser.add_argument("--burst-kb", type=int, default=256, help="tbf burst (above the MTU)")
    parser.add_argument("--mtu", type=int, default=65000)
    parser.add_argument("--latency-ms", type=int, default=400, help="tbf queue limit, as delay")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return _link_worker(options)
    if options.burst_kb * 1024 <= options.mtu:
        parser.error(f"--burst-kb {options.burst_kb}: expected above the MTU ({options.mtu} B)")
    if options.rate_mbit:  # before the long loopback part: a link that cannot be made stops it
        why_not = emulated_link(LINK_NODES, options.rate_mbit, options.burst_kb,
                                options.latency_ms, options.mtu)  # fmt: skip
        if why_not is not None:
            raise SystemExit(
                f"torchtitan_adapters benchmark: no emulated nodes ({why_not}); "
                "--rate-mbit 0 leaves the throttled-link phase out"
            )
    out = Path(tempfile.mkdtemp(prefix="torchtitan-adapters-"))
    report: dict[str, Any] = {
        "benchmark": "torchtitan_adapters",
        "cpu_count": os.cpu_count(),
        "job": "deepseek_v3 debugmodel, FSDP2, full activation checkpointing, debug batches",
        "worlds": {},
    }
    try:
        for world in options.worlds:
            ranks = run_ranks(_configurations, world, _job(options, str(out / "data")))
            report["worlds"][str(world)] = _summary(world, ranks[0])
        if options.rate_mbit:
            report["throttled_link"] = {
                "link": f"veth between two network namespaces (MTU {options.mtu}), tc tbf rate "
                f"{options.rate_mbit:g} Mbit/s, burst {options.burst_kb} KiB, latency "
                f"{options.latency_ms} ms, each direction; ranks of one node over its loopback",
                "configurations": _over_link(options, out),
            }
    finally:
        if options.rate_mbit:
            teardown(LINK_NODES)
        shutil.rmtree(out, ignore_errors=True)
    if options.json:
        print(json.dumps(report, indent=2))
        return
    for world, summary in report["worlds"].items():
        for name, entry in summary.items():
            print(f"{world} ranks  {name:<12} {entry}")
    for name, entry in report.get("throttled_link", {}).get("configurations", {}).items():
        print(f"4 ranks, throttled link  {name:<14} {entry}")


if __name__ == "__main__":
    main()
