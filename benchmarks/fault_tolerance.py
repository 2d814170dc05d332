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
  For each: the steps done, the steps redone or retried, and the wall time lost against the
  same configuration's clean run.

    python benchmarks/fault_tolerance.py [--json] [--steps 40] [--kill-at 12] [--every 5]
        [--repeats 3]
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


def _run(args, root: Path, name: str, *extra: str, kill: tuple[Path, Path] | None = None):
    """One ``europa train``; with ``kill`` (its metrics file, the progress file of the worker
    to kill), SIGKILL that worker once ``--kill-at`` steps are logged. Returns the wall time
    and the exit code."""
    run_dir = root / name
    started = time.perf_counter()
    proc = _train(args, run_dir, *extra)
    killed = False
    while proc.poll() is None:
        if kill is not None and not killed:
            metrics, progress = kill
            if any(r["step"] >= args.kill_at for r in _records(run_dir / metrics)):
                pid = _pid_of(run_dir / progress)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
        time.sleep(0.02)
    return time.perf_counter() - started, proc.returncode, killed


def _summary(records: list[dict], warmup: int = 2) -> dict:
    done = [r for r in records if r.get("committed", True)]
    steps = [r["step_time_s"] for r in done[warmup:]]
    return {
        "steps_logged": len(records),
        "last_step": done[-1]["step"] if done else 0,
        "median_step_s": statistics.median(steps) if steps else None,
        "retried_steps": sorted({r["step"] for r in records if not r.get("committed", True)}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=12, help="SIGKILL a worker after this step")
    parser.add_argument("--every", type=int, default=5, help="save every N steps")
    parser.add_argument("--repeats", type=int, default=3, help="clean runs of each, in turns")
    args = parser.parse_args()
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at: expected a step before --steps")
    root = Path(tempfile.mkdtemp(prefix="europa-ft-"))
    began = time.perf_counter()
    out: dict = {"benchmark": "fault_tolerance", "preset": "tiny", "replicas": REPLICAS,
                 "ranks_per_replica": 1, "steps": args.steps, "kill_at": args.kill_at,
                 "save_every": args.every, "cpu_count": os.cpu_count()}  # fmt: skip

    # The clean runs in turns (plain, torchft, plain, ...), so machine noise hits both; the
    # cost is the median over the pairs of torchft's median step over plain's.
    clean: dict[str, list[dict]] = {"plain": [], "torchft": []}
    for turn in range(args.repeats):
        for name, extra, metrics in (("plain", (), "metrics.jsonl"),
                                     ("torchft", FT, "replica-0/metrics.jsonl")):  # fmt: skip
            run = f"{name}-clean-{turn}"
            wall, code, _ = _run(args, root, run, *extra)
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
    cases = (
        ("no_fault_tolerance", (), "metrics.jsonl", "progress/rank-1.json", "plain"),
        ("elastic_restart", ("--max-restarts", "1"), "metrics.jsonl", "progress/rank-1.json",
         "plain"),
        ("torchft", (*FT, "--max-restarts", "1"), "replica-0/metrics.jsonl",
         "replica-1/progress/rank-0.json", "torchft"),
    )  # fmt: skip
    for name, extra, metrics, victim, baseline in cases:
        wall, code, killed = _run(args, root, name, *extra, kill=(metrics, victim))
        summary = _summary(_records(root / name / metrics))
        saved = args.kill_at // args.every * args.every  # the last save before the kill
        redone = args.kill_at - saved  # what a restart from it redoes, a stopped job lost
        failures[name] = {
            "killed": killed,
            "exit_code": code,
            "wall_s": wall,
            "wall_lost_s": wall - baseline_wall[baseline] if code == 0 else None,
            "finished": code == 0 and summary["last_step"] == args.steps,
            **summary,
            # with torchft, the steps the other group retried instead
            "steps_lost": len(summary["retried_steps"]) if name == "torchft" else redone,
        }
    out["failure"] = failures
    out["wall_s"] = time.perf_counter() - began
    out["run_dirs"] = str(root)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
