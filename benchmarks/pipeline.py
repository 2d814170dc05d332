"""Pipeline stages across two emulated nodes: each schedule against the same layout
without stages, and torchtitan's own Trainer with its own pipeline, in one run.

Four ranks as two nodes of two (``_netns``: a node's ranks talk over its loopback, the
nodes over a veth pair rate-limited with ``tc tbf``). Every europa configuration is a
Trainer on every rank with ``-p flexshard``, ``parallel.ep=2`` and the non-expert matrices
over each node's ranks (``flexshard.dense_group="node"``), on the debug preset with the
same global batch (16 sequences a step): without stages, 4 data ranks × 4 micro-batches;
with ``parallel.pp=2``, one stage a node (its 2 ranks its ep group), 2 data ranks × 8
micro-batches, under 1F1B, interleaved 1F1B, ZBV zero-bubble and DualPipeV (its paired
chunks side by side in two threads, ``parallel.pp_overlap_f_b="on"``, and in turn, as torch
runs them). They are built in the same four processes and stepped in turns (one step of
each, then the next), so machine noise hits all. Per configuration, over the steps after
the warm-up one:

* the median step, and the exposed exchange: the training blocked in an expert
  all-to-all with nothing computing beside it (``ExchangeClock``), with its share of the
  step;
* with stages, each pipeline rank's bubble (the share of the schedule's run it waited,
  ``pipeline_bubble``) beside the plan's (``europa plan`` with the emulated link's rate and
  the cpu profile's compute), and the bytes its stages sent (``pipeline_sent_bytes``,
  counted at torch's send ops) beside the plan's;
* the losses.

Then the exchange across the link: the same 4 ranks placed in turn on the two nodes, so
each stage's two ranks (its ep group) sit on different nodes and its expert exchange
crosses the emulated link, while a hidden state goes to the other stage's rank on the same
node. 1F1B and DualPipeV side by side and in turn: the exchange each leaves exposed.

Then the bubble alone, where a waiting rank is an idle core: 2 ranks, one a node (so one
a core), ``parallel.pp=2`` with core's layout (one data rank a stage), each schedule,
8 micro-batches: each rank's measured bubble beside the plan's.

Then torchtitan 0.3.0's Trainer with ``pipeline_parallel_degree=2`` on the same model,
ranks and link, or the one line saying why it did not run.

Needs root for ``ip netns`` and ``tc``; without them it stops and says why.

    python benchmarks/pipeline.py [--json] [--steps 5] [--rate-mbit 100]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _exchange_clock import ExchangeClock
from _harness import first_failure, write_gathered
from _netns import TwoNodes, emulated_link, teardown

NODES = TwoNodes(("europa-pp0", "europa-pp1"), ("10.233.0.1", "10.233.0.2"))
RANKS, PER_NODE = 4, 2
PORT = 29691
SEQUENCES = 16  # a step's global batch
SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv", "dualpipev")
STAGED = ["parallel.pp=2", f"training.grad_accum_steps={SEQUENCES // 2}"]
SIDE_BY_SIDE = ['parallel.pp_schedule="dualpipev"', 'parallel.pp_overlap_f_b="on"']


@dataclass(frozen=True)
class Phase:
    ranks: int
    per_node: int
    plugins: tuple[str, ...]
    settings: tuple[str, ...]  # what every configuration of the phase shares
    configs: dict[str, list[str]]
    alternate: bool = False  # ranks on the two nodes in turn (rank r on node r % 2)

    def node_of(self, rank: int) -> int:
        return rank % 2 if self.alternate else rank // self.per_node

    def common(self, args) -> list[str]:
        return [
            *self.settings,
            f"parallel.ranks_per_node={self.per_node}",
            "training.batch_size=1",
            f"training.seq_len={args.seq_len}",
            f"training.steps={args.steps}",
            "metrics.progress=false",
            'parallel.device="cpu"',
        ]


PHASES = {
    "layouts": Phase(
        RANKS,
        PER_NODE,
        ("flexshard",),
        ("parallel.ep=2", 'flexshard.dense_group="node"', "flexshard.log_plan=false"),
        {
            "no_stages": [f"training.grad_accum_steps={SEQUENCES // 4}"],
            **{name: [*STAGED, f'parallel.pp_schedule="{name}"'] for name in SCHEDULES},
            "dualpipev": [*STAGED, *SIDE_BY_SIDE],
            "dualpipev_in_turn": [*STAGED, 'parallel.pp_schedule="dualpipev"'],
        },
    ),
    # Each stage's two ranks on different nodes (ranks alternate), so its expert exchange
    # crosses the emulated link, and a stage's hidden state goes to the other stage's rank
    # on the same node: the exchange DualPipeV's pairs may hide, 1F1B beside it. Every rank
    # is its own node to europa (its ep group spans two), the exchange flat.
    "exchange": Phase(
        RANKS,
        1,
        ("flexshard",),
        (
            "parallel.ep=2",
            'parallel.ep_dispatch="flat"',
            'flexshard.dense_group="node"',
            "flexshard.log_plan=false",
            *STAGED,
        ),
        {
            "1f1b": [],
            "dualpipev": SIDE_BY_SIDE,
            "dualpipev_in_turn": ['parallel.pp_schedule="dualpipev"'],
        },
        alternate=True,
    ),
    "bubble": Phase(
        2,
        1,
        (),
        ("parallel.pp=2", "training.grad_accum_steps=8"),
        {name: [f'parallel.pp_schedule="{name}"'] for name in SCHEDULES},
    ),
}


def _trainer(args, phase: Phase, overrides: list[str], run_dir: Path):
    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config, manager = open_session("debug", [*phase.common(args), *overrides], phase.plugins)
    device, mesh = init_distributed(config.parallel, ProcessPlace(rank, world, rank, "torchrun"))
    job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world, local_rank=rank,
              ranks_per_node=phase.per_node, device=device, mesh=mesh)  # fmt: skip
    return Trainer(job, manager)


def _planned(args, phase: Phase, overrides: list[str]) -> dict | None:
    """The plan's pipeline figures for the emulated machine: the cpu profile's compute,
    the veth's rate between nodes."""
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    config, manager = open_session("debug", [*phase.common(args), *overrides], phase.plugins)
    link = args.rate_mbit * 1e6 / 8 / 1e9  # GB/s
    hardware = dataclasses.replace(
        load_profile("cpu"),
        inter_node_gbps=link,
        inter_node_efficiency=1.0,
        inter_node_collectives=None,
    )
    plan = make_plan(config, manager, hardware, phase.ranks, ranks_per_node=phase.per_node)
    pipeline = plan.pipeline
    if pipeline is None:
        return None
    return {
        "bubble": [r.bubble for r in pipeline.ranks],
        "sent_bytes": [r.send_bytes for r in pipeline.ranks],
        "step_s": pipeline.step_s,
        "paired_hidden_s": pipeline.paired_hidden_s,
    }


def europa_worker(args) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    phase = PHASES[args.phase]
    trainers = {
        name: _trainer(args, phase, extra, out / args.phase / name)
        for name, extra in phase.configs.items()
    }
    clock = ExchangeClock()
    records: dict[str, list[dict]] = {name: [] for name in trainers}
    for step in range(args.steps):
        for name, trainer in trainers.items():
            dist.barrier()  # each configuration's step starts together on every rank
            clock.take()
            record = trainer.step(step)
            record["exposed_exchange_s"] = clock.take()
            records[name].append({k: v for k, v in record.items() if not isinstance(v, dict)})
    mine = {"records": records}
    if dist.get_rank() == 0:
        mine["planned"] = {
            name: _planned(args, phase, extra) for name, extra in phase.configs.items()
        }
    write_gathered(out / f"{args.phase}.json", mine)


def torchtitan_worker(args) -> None:
    from _torchtitan_cpu import run_trainer  # patches torchtitan on import

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    overrides = [
        "training.batch_size=1",
        f"training.seq_len={args.seq_len}",
        f"training.grad_accum_steps={SEQUENCES // 2}",
    ]
    result = run_trainer(rank, world, {
        "preset": "debug", "overrides": overrides, "fp32_experts": True, "replicate": False,
        "ep": 2, "pp": 2, "pp_schedule": "1F1B", "log_every": 1,
        "data_dir": str(Path(args.out) / "torchtitan-data"),
        "steps": args.steps + 1, "warmup": 1, "timed": args.steps - 1, "profiled": 1,
    })  # fmt: skip
    if rank == 0:
        (Path(args.out) / "torchtitan.json").write_text(json.dumps(result))


def _launch(args, out: Path, worker: str, phase: str = "layouts") -> str | None:
    """Run the ranks of ``worker`` (and ``phase``) on the emulated nodes; None, or the
    failure's last line."""
    _launch.count = getattr(_launch, "count", 0) + 1  # a fresh port each time
    procs, logs = [], []
    ranks, per_node = PHASES[phase].ranks, PHASES[phase].per_node
    for rank in range(ranks):
        node = PHASES[phase].node_of(rank)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                   MASTER_PORT=str(PORT + _launch.count), **NODES.environment(node))  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", worker, "--phase", phase, "--out", str(out),
               "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--threads", str(args.threads), "--rate-mbit", str(args.rate_mbit)]  # fmt: skip
        log = out / f"{worker}-{phase}-rank{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen(NODES.command(node, cmd), env=env, stdout=log.open("w"),
                                      stderr=subprocess.STDOUT))  # fmt: skip
    return first_failure(procs, logs)


def _summary(gathered: list[dict], phase: Phase) -> dict:
    """Per configuration, over the steps after the warm-up: medians over steps of the
    slowest rank's figures."""
    planned = gathered[0]["planned"]
    out = {}
    for name in phase.configs:
        per_rank = [g["records"][name][1:] for g in gathered]
        steps = [max(r[i]["step_time_s"] for r in per_rank) for i in range(len(per_rank[0]))]
        exposed = [max(r[i]["exposed_exchange_s"] for r in per_rank) for i in range(len(steps))]
        first = per_rank[0]
        summary = {
            "step_s": statistics.median(steps),
            "exposed_exchange_s": statistics.median(exposed),
            "exposed_exchange_share": statistics.median(
                e / s for e, s in zip(exposed, steps, strict=True)
            ),
            "losses": [r["loss"] for r in gathered[0]["records"][name]],
        }
        if "pipeline_bubble" in first[0]:
            pipeline_ranks = len(first[0]["pipeline_bubble"])
            bubble = [statistics.median(r["pipeline_bubble"][p] for r in first)
                      for p in range(pipeline_ranks)]  # fmt: skip
            sent = first[0]["pipeline_sent_bytes"]
            plan = planned[name]
            mean_measured = sum(bubble) / len(bubble)
            mean_planned = sum(plan["bubble"]) / len(plan["bubble"])
            summary.update(
                bubble_measured=bubble,
                bubble_planned=plan["bubble"],
                step_planned_s=plan["step_s"],
                paired_hidden_planned_s=plan["paired_hidden_s"],
                bubble_planned_over_measured=mean_planned / mean_measured,
                sent_bytes_counted=sent,
                sent_bytes_planned=plan["sent_bytes"],
                sent_bytes_equal_plan=all(
                    r["pipeline_sent_bytes"] == plan["sent_bytes"] for r in first
                ),
            )
        out[name] = summary
    return out


def _ratio(config: dict, baseline: dict, key: str = "exposed_exchange_s") -> float | None:
    return config[key] / baseline[key] if baseline[key] else None


def _worst(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=int, default=5, help="per configuration, 1 warm-up")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="emulated link rate")
    parser.add_argument("--burst-kb", type=int, default=256, help="tbf burst (above the MTU)")
    parser.add_argument("--mtu", type=int, default=65000)
    parser.add_argument("--latency-ms", type=int, default=400, help="tbf queue limit, as delay")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--skip-torchtitan", action="store_true")
    parser.add_argument("--keep-logs", help="keep the ranks' logs in this directory")
    parser.add_argument("--worker", choices=("europa", "torchtitan"), help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=tuple(PHASES), default="layouts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "europa":
        return europa_worker(args)
    if args.worker == "torchtitan":
        return torchtitan_worker(args)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a warm-up step and a timed one)")
    why_not = emulated_link(NODES, args.rate_mbit, args.burst_kb, args.latency_ms, args.mtu)
    if why_not is not None:
        raise SystemExit(f"pipeline benchmark: no emulated nodes ({why_not})")
    out = Path(args.keep_logs or tempfile.mkdtemp(prefix="europa-pp-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        for phase in PHASES:
            failed = _launch(args, out, "europa", phase)
            if failed:
                raise SystemExit(f"pipeline benchmark: europa ({phase}) failed: {failed}")
        titan_failed = "skipped (--skip-torchtitan)"
        if not args.skip_torchtitan:
            titan_failed = _launch(args, out, "torchtitan")
    finally:
        teardown(NODES)
    layouts = PHASES["layouts"]
    configs = _summary(json.loads((out / "layouts.json").read_text()), layouts)
    across = _summary(json.loads((out / "exchange.json").read_text()), PHASES["exchange"])
    bubble = _summary(json.loads((out / "bubble.json").read_text()), PHASES["bubble"])
    torchtitan = None if titan_failed else json.loads((out / "torchtitan.json").read_text())
    base, one_f = configs["no_stages"], configs["1f1b"]
    result = {
        "benchmark": "pipeline",
        "preset": "debug",
        "ranks": RANKS,
        "nodes": f"2 emulated nodes of {PER_NODE} ranks; with stages, one stage a node",
        "settings": {
            name: [*layouts.common(args), *extra] for name, extra in layouts.configs.items()
        },
        "plugins": list(layouts.plugins),
        "link": f"veth between two network namespaces (MTU {args.mtu}), tc tbf rate "
        f"{args.rate_mbit:g} Mbit/s, burst {args.burst_kb} KiB, latency {args.latency_ms} ms, "
        "each direction; ranks of one node over its loopback",
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "torch_threads_per_rank": args.threads,
        "wall_s": time.perf_counter() - started,
        "configs": configs,
        "exchange_across_link": {
            "ranks": "4 alternating between the nodes: a stage's ep group across the link",
            "configs": {
                name: {k: v for k, v in c.items() if k != "losses"} for name, c in across.items()
            },
        },
        "bubble_alone": {
            "ranks": "2, one a node (one a core), core's layout, parallel.pp=2, 8 micro-batches",
            "configs": {
                name: {k: v for k, v in c.items() if k != "losses"} for name, c in bubble.items()
            },
        },
        "torchtitan": torchtitan if torchtitan is not None else {"did_not_run": titan_failed},
        "comparisons": {
            "step_over_no_stages": {n: c["step_s"] / base["step_s"] for n, c in configs.items()},
            "dualpipev_over_1f1b_exposed_exchange": _ratio(configs["dualpipev"], one_f),
            "dualpipev_side_by_side_over_in_turn": {
                "exposed_exchange": _ratio(configs["dualpipev"], configs["dualpipev_in_turn"]),
                "step": _ratio(configs["dualpipev"], configs["dualpipev_in_turn"], "step_s"),
            },
            "exchange_across_link": {
                "dualpipev_over_1f1b_exposed_exchange": _ratio(across["dualpipev"], across["1f1b"]),
                "dualpipev_side_by_side_over_in_turn": {
                    "exposed_exchange": _ratio(across["dualpipev"], across["dualpipev_in_turn"]),
                    "step": _ratio(across["dualpipev"], across["dualpipev_in_turn"], "step_s"),
                },
                "max_relative_loss_difference_to_1f1b": {
                    n: _worst(c["losses"], across["1f1b"]["losses"]) for n, c in across.items()
                },
            },
            "bubble_planned_over_measured": {
                n: c["bubble_planned_over_measured"] for n, c in configs.items() if n != "no_stages"
            },
            "bubble_alone_planned_over_measured": {
                n: c["bubble_planned_over_measured"] for n, c in bubble.items()
            },
            "sent_bytes_equal_plan": {
                n: c["sent_bytes_equal_plan"] for n, c in configs.items() if n != "no_stages"
            },
            "max_relative_loss_difference_to_no_stages": {
                n: _worst(c["losses"], base["losses"]) for n, c in configs.items()
            },
        },
    }
    if not args.keep_logs:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
