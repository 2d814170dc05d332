"""europa-overlap on an emulated interconnect: the same training with and without overlap.

Two ranks, each in its own network namespace (``_netns``: a veth pair between
them, rate-limited with ``tc ... tbf``), so that communication weighs as it does
between nodes rather than over loopback, where gloo's communication thread
mostly competes with compute for the cores. Each namespace is a node to europa
(``LOCAL_WORLD_SIZE = 1``: overlap chunks the expert exchange as across nodes, with
``overlap.expert_chunks``), and the exchange is the flat one either way
(``parallel.ep_dispatch = "flat"``). Each rank builds two trainers on
the same model, data and optimizer (``-p flexshard`` with ``parallel.ep = 2`` by
default, both with ``-p overlap``):

* without overlap: ``overlap.prefetch_depth = 0``, ``overlap.expert_chunks = 0``,
  ``overlap.reduce_scatter_async = false`` (FlexShard's own synchronous gathers,
  reduce-scatters and all-to-all; the plugin only records the timeline);
* with overlap: the ``[overlap]`` defaults;

and steps them in turns (one step of each, then the next), so machine noise
hits both. Reported: median step time and exposed communication (the
training thread blocked on a collective, mean over ranks) over the steps after
the first, the ratios, and whether the losses are identical step by step.

Needs root for ``ip netns`` and ``tc``; without them it says so on stderr and
runs the ranks over loopback, labelled ``"link": "loopback"`` in the JSON.

    python benchmarks/overlap.py [--json] [--steps 20] [--rate-mbit 300] [--preset debug]
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import TwoNodes, emulated_link, teardown

NODES = TwoNodes(("europa-ov0", "europa-ov1"), ("10.231.0.1", "10.231.0.2"))
PORT = 29581
WITHOUT = [
    "overlap.prefetch_depth=0",
    "overlap.expert_chunks=0",
    "overlap.reduce_scatter_async=false",
]


# -- one rank -----------------------------------------------------------------------------


def _trainer(args, overrides: list[str], run_dir: Path):
    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    settings = [
        *args.set,
        f"parallel.ep={args.ep}",
        'parallel.ep_dispatch="flat"',  # one all-to-all, whether the ranks share a node or not
        f"training.steps={args.steps}",
        "metrics.progress=false",
        'parallel.device="cpu"',
        "flexshard.log_plan=false",
        *overrides,
    ]
    config, manager = open_session(args.preset, settings, ["flexshard", "overlap"])
    device, mesh = init_distributed(config.parallel, ProcessPlace(rank, world, rank, "torchrun"))
    job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world, local_rank=rank,
              ranks_per_node=per_node, device=device, mesh=mesh)  # fmt: skip
    return Trainer(job, manager)


def worker(args) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    trainers = {
        "without_overlap": _trainer(args, WITHOUT, out / "without_overlap"),
        "with_overlap": _trainer(args, [], out / "with_overlap"),
    }
    records: dict[str, list[dict]] = {name: [] for name in trainers}
    for step in range(args.steps):
        for name, trainer in trainers.items():
            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            record = trainer.step(step)
            record["main_thread_cpu_s"] = time.thread_time() - thread_cpu
            record["process_cpu_s"] = time.process_time() - process_cpu
            trainer.plugins.hook.europa_after_step(job=trainer.job, step=step, metrics=record)
            records[name].append({k: v for k, v in record.items() if not isinstance(v, dict)})
    if int(os.environ["RANK"]) == 0:
        (out / "records.json").write_text(json.dumps(records))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------


def _ranks_per_node(link: str) -> int:
    return 1 if link == "emulated" else 2  # a namespace stands for a node


def _launch(args, out: Path, link: str) -> None:
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(_ranks_per_node(link)), MASTER_PORT=str(PORT))  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "--out", str(out), *_forwarded(args)]
        if link == "emulated":
            env.update(NODES.environment(rank))
            cmd = NODES.command(rank, cmd)
        else:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"overlap benchmark: a rank failed (exit codes {codes})")


def _forwarded(args) -> list[str]:
    out = ["--steps", str(args.steps), "--preset", args.preset, "--ep", str(args.ep),
           "--threads", str(args.threads)]  # fmt: skip
    for setting in args.set:
        out += ["--set", setting]
    return out


def _summary(records: list[dict]) -> dict:
    timed = records[1:]  # the first step warms up
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "exposed_comm_s": statistics.median(r["overlap_exposed_comm_s"] for r in timed),
        "comm_s": statistics.median(r["overlap_comm_s"] for r in timed),
        "compute_s": statistics.median(r["overlap_compute_s"] for r in timed),
        # CPU seconds rank 0 used in a step: its training thread, and all its threads
        # (gloo's, the kernel's socket work on their behalf): what competes for the cores.
        "training_thread_cpu_s": statistics.median(r["main_thread_cpu_s"] for r in timed),
        "process_cpu_s": statistics.median(r["process_cpu_s"] for r in timed),
        "exposed_by_kind_s": {
            key.removeprefix("overlap_").removesuffix("_exposed_s"): statistics.median(
                r[key] for r in timed
            )
            for key in timed[0]
            if key.endswith("_exposed_s")
        },
        "losses": [r["loss"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=300.0, help="emulated link rate")
    parser.add_argument("--burst-kb", type=int, default=256, help="tbf burst (above the MTU)")
    parser.add_argument("--mtu", type=int, default=65000, help="veth MTU (fewer packets: less CPU)")
    parser.add_argument("--latency-ms", type=int, default=100, help="tbf queue limit, as delay")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE settings")
    parser.add_argument("--trace-dir", help="keep both runs' timelines here (europa trace DIR/…)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.steps < 3:
        parser.error("--steps must be at least 3 (one warm-up step, then timed ones)")

    if args.burst_kb * 1024 <= args.mtu:
        parser.error(f"--burst-kb {args.burst_kb}: expected more than the MTU ({args.mtu} bytes)")
    why_not = emulated_link(NODES, args.rate_mbit, args.burst_kb, args.latency_ms, args.mtu)
    link = "emulated" if why_not is None else "loopback"
    if why_not is not None:
        print(f"overlap benchmark: no emulated link ({why_not}); running over loopback, where "
              "gloo's thread competes with compute for the cores", file=sys.stderr)  # fmt: skip
    out = Path(args.trace_dir) if args.trace_dir else Path(tempfile.mkdtemp(prefix="europa-ov-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        _launch(args, out, link)
    finally:
        if link == "emulated":
            teardown(NODES)
    records = json.loads((out / "records.json").read_text())
    configs = {name: _summary(rs) for name, rs in records.items()}
    without, with_ = configs["without_overlap"], configs["with_overlap"]
    result = {
        "benchmark": "overlap",
        "preset": args.preset,
        "ranks": 2,
        "plugins": ["flexshard", "overlap"],
        "settings": [f"parallel.ep={args.ep}", 'parallel.ep_dispatch="flat"', *args.set],
        "ranks_per_node": _ranks_per_node(link),
        "steps": args.steps,
        "link": link,
        "link_detail": (
            f"veth between two network namespaces (MTU {args.mtu}), tc tbf rate "
            f"{args.rate_mbit:g} Mbit/s, burst {args.burst_kb} KiB, latency {args.latency_ms} ms, "
            "each direction"
            if link == "emulated"
            else f"loopback: {why_not}"
        ),
        "cpu_count": os.cpu_count(),
        "torch_threads_per_rank": args.threads,
        "load_average_at_end": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
        "configs": {k: {x: y for x, y in v.items() if x != "losses"} for k, v in configs.items()},
        "comparisons": {
            "step_time_without_over_with": without["step_s"] / with_["step_s"],
            "exposed_comm_reduction": 1 - with_["exposed_comm_s"] / without["exposed_comm_s"],
            "losses_identical": without["losses"] == with_["losses"],
            "losses": with_["losses"],
        },
    }
    if not args.trace_dir:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
