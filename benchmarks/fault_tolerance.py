"""One failure three ways, and what fault tolerance costs when nothing fails.

Two data-parallel replicas of one CPU rank each, the tiny preset, ``--steps`` steps with a
synchronous save every ``--every`` steps, each run a real ``europa train`` on this machine
(fresh processes, a fresh run directory):

* ``plain`` and ``torchft``: the same two replicas with nothing failing, as one job
  (``parallel.dp_replicate=2``: DDP over the two ranks) and as two replica groups meeting
  through torchft (``fault_tolerance.enabled``), ``--repeats`` times each in turns: the
  median over the pairs of their median steps' ratio is the cost of fault tolerance per
  step (the quorum and the vote each step, the gradients averaged through torchft's
  process group rather than DDP's buckets).
* The same failure, SIGKILL to one worker when ``--kill-at`` steps are done:
  * ``no_fault_tolerance``: the job as ``plain``, no restarts: it stops, and the steps since
    its last save are lost with the rest of the run until someone resumes it;
  * ``elastic_restart``: the job with ``--max-restarts 1``: every worker restarts and
    resumes from the last save on disk, redoing the steps since it;
  * ``torchft``: the groups with ``--max-restarts 1``: the other group steps on, the killed
    group's worker restarts and heals from it without reading the disk.
  For each: the steps done, the steps redone or retried, the wall time lost against the
  same configuration's clean run (every run launched with ``--max-restarts 1``, so all
  spawn the same workers), that loss plus the time the clean run takes to train the
  tokens a group away did not (torchft steps on with the groups left), and the seconds
  from the kill to the first step every replica took part in again.
* The torchft failure again at each ``--heartbeats`` Lighthouse heartbeat timeout: the
  Lighthouse waits that long for the dead group before the others' retried step forms a
  quorum without it (``fault_tolerance.heartbeat_timeout_s`` is chosen from these).
* ``seed_planned``: the planner's figures for the same failure at the seed's size (a
  prediction): a restart from disk against a heal from a peer, in seconds of the whole
  job lost.

    python benchmarks/fault_tolerance.py [--json] [--steps 40] [--kill-at 12] [--every 5]
        [--repeats 3] [--heartbeats 5,1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPLICAS = 2
QUIET = ["--set", "metrics.progress=false"]


def _records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]


def _pid_of(progress: Path) -> int | None:
    try:
        return json.loads(progress.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _train(args, run_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "europa.cli", "train", "tiny", "--nproc", str(REPLICAS),
               "--run-dir", str(run_dir), "--set", f"training.steps={args.steps}",
               "--set", f"checkpoint.every={args.every}", "--set", "checkpoint.keep=0",
               "--set", f"parallel.dp_replicate={REPLICAS}", *QUIET, *extra]  # fmt: skip
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


FT = ["--set", "fault_tolerance.enabled=true"]
RESTARTS = ("--max-restarts", "1")  # clean runs launch as the failures do: workers spawned

# The seed (docs/plan.md): its best layout without stages, on JUPITER's profile with a file
# system rate (5 GB/s a node: an illustration, as docs/plan.md's goodput example).
SEED = ["kimi-k2", "--replicas", "4", "--gpus-per-replica", "384", "--search",
        "--set", "parallel.ep_max_nodes_per_token=4"]  # fmt: skip
SEED_FILESYSTEM_GBPS = 5.0


def _run(args, root: Path, name: str, *extra: str, kill: tuple[Path, Path] | None = None):
    """One ``europa train``; with ``kill`` (its metrics file, the progress file of the worker
    to kill), SIGKILL that worker once ``--kill-at`` steps are logged. Returns the wall time,
    the exit code, whether it killed, and the seconds from the kill to the first step every
    replica took part in again (a record logged after the kill with every replica; without
    torchft every step has them all)."""
    run_dir = root / name
    started = time.perf_counter()
    proc = _train(args, run_dir, *[a for key in args.set for a in ("--set", key)], *extra)
    killed_at = whole_s = None
    before: set[tuple] = set()  # the records logged before the kill (a restart rewrites them)
    while proc.poll() is None:
        if kill is not None and whole_s is None:
            metrics, progress = kill
            records = _records(run_dir / metrics)
            if killed_at is None and any(r["step"] >= args.kill_at for r in records):
                pid = _pid_of(run_dir / progress)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.perf_counter()
                    before = {(r["step"], r["step_time_s"]) for r in records}
            elif killed_at is not None and any(
                (r["step"], r["step_time_s"]) not in before
                and r.get("replicas", REPLICAS) == REPLICAS
                and r.get("committed", True)
                for r in records
            ):
                whole_s = time.perf_counter() - killed_at
        time.sleep(0.02)
    return time.perf_counter() - started, proc.returncode, killed_at is not None, whole_s


def seed_planned() -> dict:
    """The planner's figures for the same failure at the seed's size (a prediction): a
    restart from disk stops all 1,536 GPUs, which restart, read the checkpoint and redo half
    a save interval (Young–Daly's); a heal costs one of the 4 groups its restart and the
    transfer from a peer, while the others step on, and every group the step in flight."""
    from importlib import resources

    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "gh200-jupiter-fs.toml"
        text = resources.files("europa.core.plan.profiles").joinpath("gh200-jupiter.toml")
        text = text.read_text()
        profile.write_text(f"{text}\nfilesystem_gbps = {SEED_FILESYSTEM_GBPS}\n")
        planned = subprocess.run(
            [sys.executable, "-m", "europa.cli", "plan", *SEED, "--hardware", str(profile),
             "--json"], capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    plan = json.loads(planned)
    good, step = plan["goodput"], plan["step"]["with_overlap"]["step_s"]
    restart_s = good["restart_s"] + good["read_s"] + good["young_daly_s"] / 2
    heal_s = (good["restart_s"] + good["heal_s"]) / good["replicas"] + step
    return {
        "command": "europa plan " + " ".join(SEED),
        "filesystem_gbps": SEED_FILESYSTEM_GBPS,
        "gpus": good["gpus"],
        "step_s": step,
        "restart_s": good["restart_s"],
        "read_s": good["read_s"],
        "heal_s": good["heal_s"],
        "save_interval_s": good["young_daly_s"],
        "job_seconds_lost_restart_from_disk": restart_s,
        "job_seconds_lost_heal_from_peer": heal_s,
        "goodput_restart_from_disk": good["without_ft_at_young_daly"],
        "goodput_heal_from_peer": good["with_ft_at_young_daly"],
    }


def _summary(records: list[dict], warmup: int = 2) -> dict:
    done = [r for r in records if r.get("committed", True)]
    steps = [r["step_time_s"] for r in done[warmup:]]
    return {
        "steps_logged": len(records),
        "last_step": done[-1]["step"] if done else 0,
        "median_step_s": statistics.median(steps) if steps else None,
        "tokens_seen": done[-1]["tokens_seen"] if done else 0,
        "retried_steps": sorted({r["step"] for r in records if not r.get("committed", True)}),
    }


def untrained_s(summary: dict, clean: list[dict]) -> float:
    """The seconds the clean runs would take to train the tokens this run did not: torchft
    goes on with the groups left, each step training fewer sequences until the group is
    back; a restart redoes its steps and misses none."""
    tokens = statistics.median(r["tokens_seen"] for r in clean)
    step_s = statistics.median(r["median_step_s"] for r in clean)
    steps = statistics.median(r["last_step"] for r in clean)
    return (tokens - summary["tokens_seen"]) / (tokens / steps) * step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=12, help="SIGKILL a worker after this step")
    parser.add_argument("--every", type=int, default=5, help="save every N steps")
    parser.add_argument("--repeats", type=int, default=3, help="clean runs of each, in turns")
    parser.add_argument(
        "--heartbeats",
        type=lambda text: [float(x) for x in text.split(",") if x],
        default=[5.0, 1.0],
        help="the same torchft failure again with each Lighthouse heartbeat timeout (s)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (e.g. a Lighthouse timing)",
    )
    args = parser.parse_args()
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at: expected a step before --steps")
    root = Path(tempfile.mkdtemp(prefix="europa-ft-"))
    began = time.perf_counter()
    out: dict = {"benchmark": "fault_tolerance", "preset": "tiny", "replicas": REPLICAS,
                 "ranks_per_replica": 1, "steps": args.steps, "kill_at": args.kill_at,
                 "save_every": args.every, "overrides": args.set,
                 "cpu_count": os.cpu_count()}  # fmt: skip

    # The clean runs in turns (plain, torchft, plain, ...), so machine noise hits both; the
    # cost is the median over the pairs of torchft's median step over plain's.
    clean: dict[str, list[dict]] = {"plain": [], "torchft": []}
    for turn in range(args.repeats):
        turns = (("plain", RESTARTS, "metrics.jsonl"),
                 ("torchft", (*FT, *RESTARTS), "replica-0/metrics.jsonl"))  # fmt: skip
        for name, extra, metrics in turns:
            run = f"{name}-clean-{turn}"
            wall, code, _, _ = _run(args, root, run, *extra)
            clean[name].append({"wall_s": wall, "exit_code": code,
                                **_summary(_records(root / run / metrics))})  # fmt: skip
    out["clean"] = clean
    ratios = [ft["median_step_s"] / plain["median_step_s"]
              for plain, ft in zip(clean["plain"], clean["torchft"], strict=True)]  # fmt: skip
    out["torchft_step_over_plain_per_pair"] = ratios
    out["torchft_step_over_plain"] = statistics.median(ratios)
    out["torchft_wall_over_plain"] = statistics.median(
        ft["wall_s"] / plain["wall_s"]
        for plain, ft in zip(clean["plain"], clean["torchft"], strict=True)
    )
    baseline_wall = {name: statistics.median(r["wall_s"] for r in runs)
                     for name, runs in clean.items()}  # fmt: skip

    failures = {}
    victim = "replica-1/progress/rank-0.json"
    cases = (
        ("no_fault_tolerance", (), "metrics.jsonl", "progress/rank-1.json", "plain"),
        ("elastic_restart", RESTARTS, "metrics.jsonl", "progress/rank-1.json", "plain"),
        ("torchft", (*FT, *RESTARTS), "replica-0/metrics.jsonl", victim, "torchft"),
        *((f"torchft_heartbeat_{beat}s",
           (*FT, *RESTARTS, "--set", f"fault_tolerance.heartbeat_timeout_s={beat}"),
           "replica-0/metrics.jsonl", victim, "torchft") for beat in args.heartbeats),
    )  # fmt: skip
    for name, extra, metrics, victim, baseline in cases:
        wall, code, killed, whole_s = _run(args, root, name, *extra, kill=(metrics, victim))
        summary = _summary(_records(root / name / metrics))
        saved = args.kill_at // args.every * args.every  # the last save before the kill
        redone = args.kill_at - saved  # what a restart from it redoes, a stopped job lost
        failures[name] = {
            "killed": killed,
            "exit_code": code,
            "wall_s": wall,
            "wall_lost_s": wall - baseline_wall[baseline] if code == 0 else None,
            # and the tokens a group away did not train, at the clean run's step
            "lost_with_untrained_tokens_s": (
                wall - baseline_wall[baseline] + untrained_s(summary, clean[baseline])
                if code == 0
                else None
            ),
            "finished": code == 0 and summary["last_step"] == args.steps,
            "kill_to_every_replica_s": whole_s,
            **summary,
            # with torchft, the steps the other group retried instead
            "steps_lost": len(summary["retried_steps"]) if "torchft" in name else redone,
        }
    out["failure"] = failures
    ft, restart = failures["torchft"], failures["elastic_restart"]
    out["done"] = {
        "torchft_loses_less_than_a_restart": (
            ft["lost_with_untrained_tokens_s"] < restart["lost_with_untrained_tokens_s"]
        ),
        "torchft_loses_at_most_one_step": ft["steps_lost"] <= 1,
        "torchft_step_within_5_percent": out["torchft_step_over_plain"] <= 1.05,
    }
    out["seed_planned"] = seed_planned()
    out["wall_s"] = time.perf_counter() - began
    out["run_dirs"] = str(root)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
