"""Reading a run directory as it is now: finished, stopped early or still being written."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from europa.report.errors import ReportError
from europa.spec.run_files import CONFIG_FILE, JOB_FILE, METRICS_FILE, SUMMARY_FILE

EXPECTED = "expected a run directory written by `europa train`"
REPLICA_GROUPS = "replica-[0-9]*"  # a fault-tolerant run's groups (europa.core.fault.launch)


@dataclass
class RunData:
    path: Path
    label: str  # how charts and tables name this run
    records: list[dict[str, Any]]  # metrics.jsonl, one per logged step, in step order
    config: dict[str, Any]  # config.toml parsed; empty when absent
    config_text: str
    job: dict[str, Any] | None  # job.json: world size, mesh, device, parameter counts
    summary: dict[str, Any] | None  # summary.json: only once the run has ended
    notes: list[str] = field(default_factory=list)  # what the page should say is missing

    @property
    def target_steps(self) -> int | None:
        steps = self.config.get("training", {}).get("steps")
        return steps if isinstance(steps, int) else None

    @property
    def enabled_plugins(self) -> list[str]:
        return list(self.config.get("plugins", {}).get("enabled", []))


def load_run(path: Path) -> RunData:
    if not path.is_dir():
        raise ReportError(f"RUN_DIR = {str(path)!r}: not a directory; {EXPECTED}")
    records = read_records(path / METRICS_FILE)
    if not records:
        raise ReportError(
            f"RUN_DIR = {str(path)!r}: no step recorded in {METRICS_FILE} yet; {EXPECTED} "
            "with at least one logged step"
        )
    notes: list[str] = []
    config_text = _read_text(path / CONFIG_FILE)
    try:
        config = tomllib.loads(config_text) if config_text else {}
    except tomllib.TOMLDecodeError as err:
        raise ReportError(f"{path / CONFIG_FILE}: not valid TOML ({err}); {EXPECTED}") from None
    if not config_text:
        notes.append(f"no {CONFIG_FILE}")
    job = _read_json(path / JOB_FILE, notes)
    summary = _read_json(path / SUMMARY_FILE, notes)
    return RunData(path, path.name or str(path), records, config, config_text, job, summary, notes)


def run_paths(path: Path) -> list[Path]:
    """The run directories ``path`` holds: itself, or, for a fault-tolerant run (no
    metrics of its own), each replica group's ``replica-I`` folder, in group order."""
    if (path / METRICS_FILE).is_file() or not path.is_dir():
        return [path]
    groups = [p for p in path.glob(REPLICA_GROUPS) if (p / METRICS_FILE).is_file()]
    return sorted(groups, key=lambda p: int(p.name.rpartition("-")[2])) or [path]


def load_runs(paths: list[Path]) -> list[RunData]:
    """Every run of ``paths`` (a fault-tolerant run's groups each a run, named
    ``RUN/replica-I``), labelled apart."""
    runs = []
    for given in paths:
        for path in run_paths(given):
            run = load_run(path)
            if path != given:
                run.label = f"{given.name}/{path.name}"
            runs.append(run)
    label_runs(runs)
    return runs


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a last line without its newline is still being written."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # the writer is mid-line: that step is not logged yet
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as err:
            raise ReportError(
                f"{path}:{number}: not a metrics record ({type(err).__name__}: {err}); "
                'expected one JSON object with a "step" per line'
            ) from None
        by_step[step] = record  # a step logged twice (a resume): its later record counts
    return [by_step[step] for step in sorted(by_step)]


def _read_text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _read_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    text = _read_text(path)
    if not text:
        notes.append(f"no {path.name} yet")
        return None
    try:
        value = json.loads(text)
    except ValueError:  # being written at this moment, or damaged: the page says so
        notes.append(f"{path.name} is unreadable")
        return None
    return value if isinstance(value, dict) else None


def label_runs(runs: list[RunData]) -> None:
    """Directory names, or the paths as given where two runs share a name."""
    names = [run.label for run in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = str(run.path)
