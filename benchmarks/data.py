"""Data at scale: preparation throughput, and a rank's start-up time and peak resident memory
for the embedded corpus as text, the same prepared, and a generated prepared corpus of 10 GB.

Start-up is what a rank of ``europa train`` does before its first step, in a fresh process:
``build_batches`` (for text: preparing it into the run directory's cache, as rank 0 or the
launcher does once per run) and the first batch; then 100 more batches are read. Peak resident
memory is the process's VmHWM, with the baseline after imports given beside it. The 10 GB corpus
is random token ids written by ``write_synthetic_corpus`` (tokenising 10 GB of text would take
hours on a small machine) and is deleted afterwards unless --keep.

    python benchmarks/data.py [--json] [--big-gb 10] [--workers 2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["training.seq_len=128", "training.batch_size=8"]


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def probe(data_path: str, run_dir: str) -> dict:
    """One rank (1 of 2) starting: runs in its own process."""
    from europa.core.session import open_session
    from europa.core.train.batches import build_batches

    config, _ = open_session("tiny", [*TINY, f"data.path='{data_path}'"])
    baseline = _status("VmRSS")
    started = time.perf_counter()
    batches = build_batches(config, dp_rank=1, dp_world=2, run_dir=Path(run_dir))
    batches.source.batch(0)
    startup = time.perf_counter() - started
    for step in range(1, 101):
        batches.source.batch(step)
    return {
        "startup_s": round(startup, 4),
        "rss_after_imports_mb": round(baseline / 2**20, 1),
        "peak_rss_mb": round(_status("VmHWM") / 2**20, 1),
        "sequences": batches.source.sequences.num_sequences,
        "tokens": batches.source.sequences.num_tokens,
    }


def _probe_in_child(data_path: str, run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--probe", data_path, str(run_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _throughput(inputs: list[Path], out: Path, workers: int) -> dict:
    from europa.core.data.prepare import prepare_corpus

    started = time.perf_counter()
    manifest = prepare_corpus(inputs, out, workers=workers)
    seconds = time.perf_counter() - started
    return {
        "workers": workers,
        "files": len(manifest["shards"]),
        "tokens": manifest["tokens"],
        "seconds": round(seconds, 3),
        "tokens_per_s_per_worker": round(manifest["tokens"] / seconds / workers),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--big-gb", type=float, default=10.0, help="generated corpus, GB of shards")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the generated corpora")
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe)))
        return

    from europa.core.data.corpora import embedded_corpus_file
    from europa.core.data.synthetic import write_synthetic_corpus

    root = Path(tempfile.mkdtemp(prefix="europa-data-bench-"))
    free = shutil.disk_usage(root).free
    big_bytes = int(args.big_gb * 1e9)
    if free < big_bytes * 1.2:
        sys.exit(f"benchmarks/data.py: {free / 1e9:.0f} GB free in {root}; expected 1.2 × --big-gb")
    try:
        text = root / "text"
        text.mkdir()
        for copy in range(2 * args.workers):  # several files, so every worker has some
            shutil.copy(embedded_corpus_file(), text / f"part-{copy}.txt")
        preparation = [
            _throughput([embedded_corpus_file()], root / "embedded-1", 1),
            _throughput([text], root / "copies", args.workers),
        ]
        started = time.perf_counter()
        write_synthetic_corpus(root / "big", big_bytes // 2, shard_tokens=2**29)
        generated_s = time.perf_counter() - started
        ranks = {
            "embedded_text": _probe_in_child(str(embedded_corpus_file()), root / "run-text"),
            "embedded_prepared": _probe_in_child(str(root / "embedded-1"), root / "run-prep"),
            f"generated_{args.big_gb:g}gb_prepared": _probe_in_child(
                str(root / "big"), root / "run-big"
            ),
        }
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "data",
        "cpu_count": os.cpu_count(),
        "preparation": preparation,
        "generated_corpus": {"bytes": big_bytes, "write_s": round(generated_s, 1)},
        "rank_startup": ranks,
        "kept": str(root) if args.keep else None,
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
