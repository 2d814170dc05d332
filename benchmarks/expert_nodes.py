"""Expert parallelism across two emulated nodes: the flat exchange against the two-level one
and each of its levers, and torchtitan's own Trainer, on the same model, ranks, network and
batch, in one run.

Four ranks as two nodes of two: ranks 0 and 1 in one network namespace, 2 and 3 in
another, the two joined by a veth pair rate-limited with ``tc tbf`` (``_netns``), so a
node's two ranks talk over its loopback and the nodes over the throttled link. Each
europa configuration is a Trainer on every rank (``-p flexshard``, ``parallel.ep=4``: 2
experts a rank, top-3 of 8; ``parallel.ranks_per_node=2``; the non-expert matrices over
each node's ranks, ``flexshard.dense_group="node"``, so that what crosses between nodes
is the expert exchange and one gradient all-reduce a step; full activation
checkpointing; the same fixed batch of ``--grad-accum`` micro-batches), all built in
the same four processes and stepped in turns (one step of each, then the next), so
machine noise hits all.

The model (``--shape``): ``debug-narrow`` (the default) is the debug preset's routing
(dim 256, 6 layers, 8 experts top-3) with narrow attention, one shared expert and a
narrow dense FFN, whose exchange outweighs its non-expert gradients between nodes as
the seed scenario's does; ``debug`` is the preset itself, whose 25 M non-expert
parameters' all-reduce outweighs the exchange at these batches (see ``SHAPES``). Per
configuration, over the steps after the warm-up one:

* the median step, and the exposed exchange time: the training thread blocked in an
  expert all-to-all (a synchronous one, or the wait for an asynchronous one), with its
  share of the step;
* bytes per rank per step by link (inter-node, intra-node) and kind (rows, counts),
  counted in one step by wrapping ``all_to_all_single`` (``_links``); the same bytes
  computed from that step's own routing (``europa.flexshard.exchange.traffic``); and what
  ``europa plan`` predicts for uniform routing (``europa.flexshard.planner.planned_exchange``);
* the losses.

Then torchtitan 0.3.0's Trainer (``_torchtitan_cpu``) with ``expert_parallel_degree=4``
and full activation checkpointing, in the same namespaces over the same link, on the same
model (routed experts kept in fp32, as europa's fp32 run) and batches.

Finally, with ``--loss-steps N`` (default 300), the payload dtypes' and the node limit's
effect on training the debug preset itself (one micro-batch a step, no recomputation):
the two-level exchange in fp32 (the reference), with bf16 and FP8 payloads, and with
``parallel.ep_max_nodes_per_token=1``, N steps each on loopback (the link does not
change the numbers), stepped in turns.

Needs root for ``ip netns`` and ``tc``; without them it stops and says why.

    python benchmarks/expert_nodes.py [--json] [--steps 5] [--rate-mbit 40] [--loss-steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _exchange_clock import ExchangeClock
from _harness import first_failure, write_gathered
from _netns import TwoNodes, emulated_link, teardown

NODES = TwoNodes(("europa-en0", "europa-en1"), ("10.232.0.1", "10.232.0.2"))
RANKS, PER_NODE = 4, 2
PORT = 29591
TWO_LEVEL = 'parallel.ep_dispatch="two_level"'
FP8 = 'parallel.ep_dispatch_dtype="float8_e4m3fn"'
KEPT = "parallel.ep_keep_exchanges=true"
CONFIGS = {
    "flat": ['parallel.ep_dispatch="flat"'],
    "two_level": [TWO_LEVEL],
    "two_level+bf16": [TWO_LEVEL, 'parallel.ep_dispatch_dtype="bfloat16"'],
    "two_level+fp8": [TWO_LEVEL, FP8],
    "two_level+kept": [TWO_LEVEL, KEPT],
    "all": [TWO_LEVEL, FP8, KEPT],  # every lever that keeps the model's routing
    "all+max_nodes_1": [TWO_LEVEL, FP8, KEPT, "parallel.ep_max_nodes_per_token=1"],
}
# The debug preset's routing (dim 256, 6 layers, 8 experts top-3) with narrow attention, one
# shared expert and a narrow dense FFN: 3.6 M non-expert parameters instead of 25 M, so that,
# as in the seed scenario, the expert exchange outweighs the non-expert gradients' all-reduce
# between nodes (at 4 micro-batches of 2 x 128 tokens: 45 MiB against 7 MiB per rank and step,
# as planned; the debug preset itself: 45 MiB against 49 MiB).
SHAPES = {
    "debug": [],
    "debug-narrow": [
        "model.n_heads=2",
        "model.kv_lora_rank=64",
        "model.num_shared_experts=1",
        "model.dense_hidden_dim=256",
    ],
}
LOSS_CONFIGS = {
    "two_level": [TWO_LEVEL],
    "two_level+bf16": [TWO_LEVEL, 'parallel.ep_dispatch_dtype="bfloat16"'],
    "two_level+fp8": [TWO_LEVEL, FP8],
    "two_level+max_nodes_1": [TWO_LEVEL, "parallel.ep_max_nodes_per_token=1"],
}


def _common(args, phase: str = "speed") -> list[str]:
    """The settings every configuration of a phase shares. The loss phase trains the debug
    preset itself, one micro-batch a step."""
    shape, accum = (args.shape, args.grad_accum) if phase == "speed" else ("debug", 1)
    return [
        *SHAPES[shape],
        "parallel.ep=4",
        f"parallel.ranks_per_node={PER_NODE}",
        'flexshard.dense_group="node"',
        f"training.batch_size={args.batch_size}",
        f"training.seq_len={args.seq_len}",
        f"training.grad_accum_steps={accum}",
        "metrics.progress=false",
        'parallel.device="cpu"',
        "flexshard.log_plan=false",
    ]


# -- the clocks of one rank --------------------------------------------------------------


class RoutingTap:
    """The expert ids each MoE layer's dispatcher is handed in a forward (not in a
    recomputation), while ``active``, with the experts each ep rank owns."""

    def __init__(self, model) -> None:
        import torch

        self.active = False
        self.calls: list[dict] = []
        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if hasattr(dispatcher, "begin"):
                dispatcher.begin = self._tapped(dispatcher, dispatcher.begin, torch)

    def _tapped(self, dispatcher, begin, torch):
        def tapped(x_TD, scores_TK, ids_TK, chunks=1):
            if self.active and torch._C._current_graph_task_id() == -1:
                self.calls.append({"ids": ids_TK.tolist(), "ranges": dispatcher.ranges})
            return begin(x_TD, scores_TK, ids_TK, chunks)

        return tapped


# -- a europa rank -----------------------------------------------------------------------


def _trainer(args, overrides: list[str], run_dir: Path):
    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config, manager = open_session("debug", [*_common(args, args.phase), *overrides], ["flexshard"])
    device, mesh = init_distributed(config.parallel, ProcessPlace(rank, world, rank, "torchrun"))
    job = Job(
        config=config,
        run_dir=run_dir,
        rank=rank,
        world_size=world,
        local_rank=rank,
        ranks_per_node=PER_NODE,
        device=device,
        mesh=mesh,
    )
    return Trainer(job, manager)


def _planned(trainer) -> dict[str, int]:
    from europa.flexshard.experts import routed_expert_modules
    from europa.flexshard.planner import planned_exchange

    layers = len(routed_expert_modules(trainer.model))
    return planned_exchange(trainer.job, layers)["bytes_per_step_by_link"]


def europa_worker(args) -> None:
    import warnings

    import torch
    from _links import LinkCounter

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    configs = LOSS_CONFIGS if args.phase == "losses" else CONFIGS
    steps = args.loss_steps if args.phase == "losses" else args.steps
    settings = [] if args.phase == "losses" else ['activation_checkpointing.mode="full"']
    trainers = {
        name: _trainer(args, [*settings, *extra, f"training.steps={steps}"], out / name)
        for name, extra in configs.items()
    }
    clock = ExchangeClock()
    taps = {name: RoutingTap(t.model) for name, t in trainers.items()}
    records: dict[str, list[dict]] = {name: [] for name in trainers}
    counted: dict[str, dict] = {}
    for step in range(steps):
        for name, trainer in trainers.items():
            counting = args.phase == "speed" and step == 1
            taps[name].active = counting
            clock.take()
            if counting:
                with LinkCounter(PER_NODE) as counter:
                    record = trainer.step(step)
                counted[name] = counter.bytes
            else:
                record = trainer.step(step)
            taps[name].active = False
            record["exposed_exchange_s"] = clock.take()
            records[name].append({k: v for k, v in record.items() if not isinstance(v, dict)})
    mine = {
        "records": records,
        "counted": counted,
        "routing": {name: tap.calls for name, tap in taps.items()},
        "planned": {name: _planned(t) for name, t in trainers.items()}
        if args.phase == "speed"
        else {},
    }
    write_gathered(out / f"{args.phase}.json", mine)


def torchtitan_worker(args) -> None:
    from _torchtitan_cpu import run_trainer  # patches torchtitan on import

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    overrides = [
        *SHAPES[args.shape],
        f"training.batch_size={args.batch_size}",
        f"training.seq_len={args.seq_len}",
        f"training.grad_accum_steps={args.grad_accum}",
    ]
    result = run_trainer(
        rank,
        world,
        {
            "preset": "debug",
            "overrides": overrides,
            "fp32_experts": True,
            "europa_shape": True,
            "replicate": False,
            "ep": RANKS,
            "full_ac": True,
            "log_every": 1,
            "data_dir": str(Path(args.out) / "torchtitan-data"),  # shared: rank 0 prepares it
            "steps": args.steps + 1,
            "warmup": 1,
            "timed": args.steps - 1,
            "profiled": 1,
        },
    )
    if rank == 0:
        (Path(args.out) / "torchtitan.json").write_text(json.dumps(result))


# -- the parent --------------------------------------------------------------------------


def _launch(args, out: Path, worker: str, phase: str, emulated: bool) -> str | None:
    """Run the 4 ranks of ``worker``; None, or the last line of the failure."""
    _launch.count = getattr(_launch, "count", 0) + 1  # a fresh port each time
    port = PORT + _launch.count
    procs, logs = [], []
    for rank in range(RANKS):
        node = rank // PER_NODE
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(RANKS),
            LOCAL_RANK=str(rank % 2),
            LOCAL_WORLD_SIZE=str(PER_NODE),
            MASTER_PORT=str(port),
        )
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            worker,
            "--phase",
            phase,
            "--out",
            str(out),
            *_forwarded(args),
        ]
        if emulated:
            env.update(NODES.environment(node))
            cmd = NODES.command(node, cmd)
        else:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        log = out / f"{worker}-{phase}-rank{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
    return first_failure(procs, logs)


def _forwarded(args) -> list[str]:
    return [
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--grad-accum",
        str(args.grad_accum),
        "--threads",
        str(args.threads),
        "--loss-steps",
        str(args.loss_steps),
        "--shape",
        args.shape,
    ]


def _mean_bytes(per_rank: list[dict]) -> dict[str, dict[str, float]]:
    links = per_rank[0]
    return {
        link: {kind: statistics.mean(r[link][kind] for r in per_rank) for kind in links[link]}
        for link in links
    }


def _from_routing(ranks: list[dict], name: str, keep: bool, shape: str) -> list[dict]:
    """Bytes each rank sent in the counted step, from that step's routing on every rank."""
    from europa.core.config import load_config
    from europa.flexshard.exchange.traffic import routed_bytes
    from europa.flexshard.exchange.wire import RowBytes, Wire

    config = load_config("debug", SHAPES[shape])
    dispatch = "flat" if name == "flat" else "two_level"
    dtype = next(
        (s.split("=")[1].strip('"') for s in CONFIGS[name] if "ep_dispatch_dtype" in s), "compute"
    )
    rows = RowBytes.of(dispatch, Wire(dtype, 4), config.model.dim, config.model.top_k)
    total = None
    for index in range(len(ranks[0]["routing"][name])):
        calls = [r["routing"][name][index] for r in ranks]
        sent = routed_bytes(
            [c["ids"] for c in calls],
            calls[0]["ranges"],
            PER_NODE,
            dispatch,
            rows,
            forward_passes=1 if keep else 2,
        )
        total = (
            sent
            if total is None
            else [
                {link: {k: a[link][k] + b[link][k] for k in a[link]} for link in a}
                for a, b in zip(total, sent, strict=True)
            ]
        )
    return total


def _speed_summary(ranks: list[dict], shape: str) -> dict:
    configs = {}
    for name in CONFIGS:
        per_rank = [r["records"][name][1:] for r in ranks]  # after the warm-up step
        steps = [
            statistics.mean(rs[i]["step_time_s"] for rs in per_rank)
            for i in range(len(per_rank[0]))
        ]
        timed = [
            statistics.mean(rs[i]["exposed_exchange_s"] for rs in per_rank)
            for i in range(len(per_rank[0]))
        ]
        counted = [r["counted"][name] for r in ranks]
        routing = _from_routing(ranks, name, keep=KEPT in CONFIGS[name], shape=shape)
        step, exposed = statistics.median(steps), statistics.median(timed)
        planned = ranks[0]["planned"][name]
        counted_mean = _mean_bytes(counted)
        configs[name] = {
            "settings": CONFIGS[name],
            "step_s": step,
            "exposed_exchange_s": exposed,
            "exposed_exchange_share": exposed / step,
            "bytes_per_rank_counted": counted_mean,
            "bytes_counted_equal_routing": counted == routing,
            "bytes_per_rank_from_routing": _mean_bytes(routing),
            "bytes_per_rank_planned": planned,
            "planned_over_counted": {
                link: planned[link] / sum(counted_mean[link].values())
                for link in planned
                if sum(counted_mean[link].values())
            },
            "losses": [r["loss"] for r in ranks[0]["records"][name]],
        }
    return configs


def _loss_summary(ranks: list[dict]) -> dict:
    losses = {name: [r["loss"] for r in ranks[0]["records"][name]] for name in LOSS_CONFIGS}
    base = losses["two_level"]
    out = {"steps": len(base), "final_loss": {n: ls[-1] for n, ls in losses.items()}}
    for name, ls in losses.items():
        if name == "two_level":
            continue
        gaps = [abs(a - b) / abs(b) for a, b in zip(ls, base, strict=True)]
        out[name] = {
            "relative_difference_at_last_step": gaps[-1],
            "max_relative_difference": max(gaps),
            "mean_relative_difference_last_10": statistics.mean(gaps[-10:]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=int, default=5, help="per configuration, 1 warm-up")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="debug-narrow",
        help="the model: the debug preset, or its routing with narrow attention",
    )
    parser.add_argument("--rate-mbit", type=float, default=40.0, help="emulated link rate")
    parser.add_argument("--burst-kb", type=int, default=256, help="tbf burst (above the MTU)")
    parser.add_argument("--mtu", type=int, default=65000)
    parser.add_argument("--latency-ms", type=int, default=400, help="tbf queue limit, as delay")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--loss-steps", type=int, default=300, help="0: skip the loss phase")
    parser.add_argument("--skip-torchtitan", action="store_true")
    parser.add_argument("--keep-logs", help="keep the ranks' logs in this directory")
    parser.add_argument("--worker", choices=("europa", "torchtitan"), help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="speed", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "europa":
        return europa_worker(args)
    if args.worker == "torchtitan":
        return torchtitan_worker(args)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (a warm-up step, a counted one, a timed one)")
    if args.burst_kb * 1024 <= args.mtu:
        parser.error(f"--burst-kb {args.burst_kb}: expected more than the MTU ({args.mtu} bytes)")
    why_not = emulated_link(NODES, args.rate_mbit, args.burst_kb, args.latency_ms, args.mtu)
    if why_not is not None:
        raise SystemExit(f"expert_nodes benchmark: no emulated nodes ({why_not})")
    out = Path(args.keep_logs or tempfile.mkdtemp(prefix="europa-en-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        failed = _launch(args, out, "europa", "speed", emulated=True)
        if failed:
            raise SystemExit(f"expert_nodes benchmark: europa failed: {failed}")
        titan_failed = (
            "skipped (--skip-torchtitan)"
            if args.skip_torchtitan
            else _launch(args, out, "torchtitan", "speed", emulated=True)
        )
    finally:
        teardown(NODES)
    configs = _speed_summary(json.loads((out / "speed.json").read_text()), args.shape)
    torchtitan = None if titan_failed else json.loads((out / "torchtitan.json").read_text())
    losses = None
    if args.loss_steps:
        failed = _launch(args, out, "europa", "losses", emulated=False)
        if failed:
            raise SystemExit(f"expert_nodes benchmark: the loss phase failed: {failed}")
        losses = _loss_summary(json.loads((out / "losses.json").read_text()))
    flat, best = configs["flat"], configs["all"]
    inter = {n: sum(c["bytes_per_rank_counted"]["inter_node"].values()) for n, c in configs.items()}
    result = {
        "benchmark": "expert_nodes",
        "preset": "debug",
        "shape": args.shape,
        "ranks": RANKS,
        "nodes": f"2 emulated nodes of {PER_NODE} ranks",
        "settings": [*_common(args), 'activation_checkpointing.mode="full"'],
        "link": f"veth between two network namespaces (MTU {args.mtu}), tc tbf rate "
        f"{args.rate_mbit:g} Mbit/s, burst {args.burst_kb} KiB, latency {args.latency_ms} ms, "
        "each direction; ranks of one node over its loopback",
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "torch_threads_per_rank": args.threads,
        "wall_s": time.perf_counter() - started,
        "configs": configs,
        "torchtitan": torchtitan if torchtitan is not None else {"skipped": titan_failed},
        "losses": losses,
        "comparisons": {
            "flat_exposed_exchange_share": flat["exposed_exchange_share"],
            "two_level_over_flat_inter_node_bytes": inter["two_level"] / inter["flat"],
            "counted_bytes_equal_routing": {
                n: c["bytes_counted_equal_routing"] for n, c in configs.items()
            },
            "two_level_planned_over_counted": configs["two_level"]["planned_over_counted"],
            "flat_step_over_all_levers": flat["step_s"] / best["step_s"],
            "torchtitan_step_over_all_levers": (
                torchtitan["step_s"] / best["step_s"] if torchtitan else None
            ),
            "two_level_vs_flat_max_relative_loss_difference": max(
                abs(a - b) / abs(b)
                for a, b in zip(configs["two_level"]["losses"], flat["losses"], strict=True)
            ),
        },
    }
    if not args.keep_logs:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
