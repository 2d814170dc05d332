"""What a run directory holds (names only, so light modules can refer to them)."""

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS = "checkpoints"
