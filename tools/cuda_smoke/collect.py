"""Summarise a smoke run directory: losses and median tokens/s after two steps."""

import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
tokens = [r["tokens_per_s"] for r in records[2:]] or [0]
print(
    json.dumps(
        {
            "run": run.name,
            "losses": [round(r["loss"], 4) for r in records],
            "median_tokens_per_s_after_2": sorted(tokens)[len(tokens) // 2],
            "final_loss": summary.get("final_loss"),
        }
    )
)
