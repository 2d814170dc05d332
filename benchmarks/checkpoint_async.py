"""Checkpoint saves against training: no save, a synchronous save and a background save
(``checkpoint.mode``), on a fast and on a slow file system, in one run.

Each configuration is one ``europa train PRESET --nproc 2`` (gloo, CPU) that saves every
``--every`` steps. A step's wall time is its ``step_time_s`` plus the ``checkpoint_s``
training then stopped for its save (recorded in the next step's record). Steps are grouped as:

* ``saving``: the steps that saved (their wall time includes the save's stop);
* ``after``: the ``--window`` steps after each save, while a background write runs;
* ``clean``: every other step after the first two (no save near it): the baseline.

The slow file system is ``checkpoint.max_write_mbps``, set so that one rank's write
takes ``--slow-steps`` clean steps of the fast run (the regime where a write outlasts a
step). Per configuration the JSON gives median seconds per group, the ratios to its own
clean steps, the wait at the next save (``checkpoint_wait_s``), the bytes on disk against
the unique state bytes ``europa plan`` reports, the host memory staged per rank, and the
checksum cost: crc32c alone, and DCP's writer with and without europa's checksums on the
same state, in seconds per GB.

    python benchmarks/checkpoint_async.py [--preset debug] [--steps 26] [--every 8] --json
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

import crc32c
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from europa.core.checkpoint.checksums import ChecksummingWriter
from europa.core.checkpoint.marker import read_marker

QUIET = ["--set", "metrics.progress=false"]


def train(run_dir: Path, args: argparse.Namespace, mode: str, mbps: float) -> list[dict]:
    command = [
        sys.executable, "-m", "europa.cli", "train", args.preset, "--nproc", "2",
        "--run-dir", str(run_dir), *QUIET,
        "--set", f"training.steps={args.steps}", "--set", f"checkpoint.every={args.every}",
        "--set", f'checkpoint.mode="{mode}"', "--set", f"checkpoint.max_write_mbps={mbps}",
        "--set", "checkpoint.keep=1",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def grouped(records: list[dict], window: int) -> dict[str, list[float]]:
    """Wall seconds per step, by group (a save's times are in the next step's record)."""
    stopped = {r["step"] - 1: r["checkpoint_s"] for r in records if "checkpoint_s" in r}
    near = {s + k for s in stopped for k in range(1, window + 1)}
    groups: dict[str, list[float]] = {"saving": [], "after": [], "clean": []}
    for r in records:
        wall = r["step_time_s"] + stopped.get(r["step"], 0.0)
        if r["step"] in stopped:
            groups["saving"].append(wall)
        elif r["step"] in near:
            groups["after"].append(wall)
        elif r["step"] > 2:
            groups["clean"].append(wall)
    return groups


def summary(run_dir: Path, records: list[dict], window: int, unique: int) -> dict:
    groups = grouped(records, window)
    clean = _median(groups["clean"])
    medians = {name: _median(values) for name, values in groups.items()}
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    files = read_marker(newest).files
    on_disk = sum(record.bytes for name, record in files.items() if name.endswith(".distcp"))
    around = groups["saving"] + groups["after"]
    saves = [r for r in records if "checkpoint_s" in r]
    return {
        "median_step_s": medians,
        "around_save_over_clean": round(_median(around) / clean, 3) if around else None,
        "saving_over_clean": round(medians["saving"] / clean, 3) if groups["saving"] else None,
        "stopped_for_save_s": [round(r["checkpoint_s"], 4) for r in saves],
        "wait_at_next_save_s": [
            round(r["checkpoint_wait_s"], 4) for r in saves if "checkpoint_wait_s" in r
        ],
        "staging_bytes_per_rank": max(
            (r.get("checkpoint_staging_bytes", 0) for r in saves), default=0
        ),
        "shard_bytes_on_disk": on_disk,
        "unique_state_bytes": unique,
        "disk_over_unique": round(on_disk / unique, 4),
    }


def unique_state_bytes(run_dir: Path) -> int:
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    config, plugins = open_session(str(run_dir / "config.toml"))
    return make_plan(config, plugins, load_profile("cpu"), 2).checkpoint_bytes


def checksum_cost(megabytes: int) -> dict:
    """Seconds per GB: crc32c over a buffer, and one DCP save of the same bytes through
    DCP's writer and through europa's checksumming writer (best of three each)."""
    data = torch.randn(megabytes * 2**20 // 4)
    gb = data.numel() * 4 / 1e9
    view = memoryview(data.numpy()).cast("B")
    crc = min(_seconds(lambda: crc32c.crc32c(view)) for _ in range(3))

    def save(writer_type) -> float:
        with tempfile.TemporaryDirectory() as folder:
            writer = writer_type(folder)
            return _seconds(lambda: dcp.save({"w": data}, storage_writer=writer, no_dist=True))

    plain = min(save(FileSystemWriter) for _ in range(3))
    checked = min(save(ChecksummingWriter) for _ in range(3))
    return {
        "bytes": int(gb * 1e9),
        "crc32c_s_per_gb": round(crc / gb, 4),
        "dcp_writer_s_per_gb": round(plain / gb, 4),
        "checksumming_writer_s_per_gb": round(checked / gb, 4),
        "checksumming_over_dcp_writer": round(checked / plain, 3),
    }


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=26)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--window", type=int, default=2, help="steps after a save counted")
    parser.add_argument("--slow-steps", type=float, default=1.5,
                        help="a slow write takes this many clean steps")  # fmt: skip
    parser.add_argument("--checksum-mb", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the JSON (else a table)")
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(prefix="checkpoint-async-"))
    results: dict[str, dict] = {}
    unique = None
    slow_mbps = None
    configurations = [("sync", "sync", False), ("async", "async", False),
                      ("sync_slow", "sync", True), ("async_slow", "async", True)]  # fmt: skip
    for name, mode, slow in configurations:
        run_dir = root / name
        mbps = slow_mbps if slow else 0.0
        records = train(run_dir, args, mode, mbps)
        unique = unique or unique_state_bytes(run_dir)
        results[name] = {"mode": mode, "max_write_mbps": mbps,
                         **summary(run_dir, records, args.window, unique)}  # fmt: skip
        if name == "async":  # the fast run's clean steps set the slow file system's rate
            per_rank = unique / 2
            clean = results[name]["median_step_s"]["clean"]
            slow_mbps = round(per_rank / 1e6 / (args.slow_steps * clean), 2)
    report = {
        "preset": args.preset,
        "ranks": 2,
        "steps": args.steps,
        "every": args.every,
        "cpu_count": os.cpu_count(),
        "slow_write_mbps_per_rank": slow_mbps,
        "configurations": results,
        "checksum_cost": checksum_cost(args.checksum_mb),
        "targets": {
            "async_around_save_at_most_1.1x_clean": results["async"]["around_save_over_clean"]
            <= 1.1,
            "async_slow_around_save_at_most_1.1x_clean": results["async_slow"][
                "around_save_over_clean"
            ]
            <= 1.1,
            "bytes_on_disk_within_1pct_of_unique": all(
                abs(r["disk_over_unique"] - 1) <= 0.01 for r in results.values()
            ),
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'configuration':<12} {'clean s':>8} {'saving s':>9} {'after s':>8} "
          f"{'around/clean':>13} {'disk/unique':>12}")  # fmt: skip
    for name, r in results.items():
        m = r["median_step_s"]
        print(f"{name:<12} {m['clean']:>8} {m['saving']:>9} {m['after']!s:>8} "
              f"{r['around_save_over_clean']!s:>13} {r['disk_over_unique']:>12}")  # fmt: skip
    print(json.dumps(report["checksum_cost"]))


if __name__ == "__main__":
    main()
