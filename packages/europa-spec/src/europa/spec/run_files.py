"""The files of a run directory that a reader outside the trainer opens (europa-report): their
names, shared so the reader needs nothing of europa-core. Pure Python."""

from __future__ import annotations

CONFIG_FILE = "config.toml"  # the resolved config, TOML
METRICS_FILE = "metrics.jsonl"  # one record per logged step (europa.spec.metrics)
SUMMARY_FILE = "summary.json"  # written once the run has ended
JOB_FILE = "job.json"  # world size, mesh, device, parameter counts; written at the start


__all__ = ["CONFIG_FILE", "JOB_FILE", "METRICS_FILE", "SUMMARY_FILE"]
