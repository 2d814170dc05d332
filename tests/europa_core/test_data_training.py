"""Training on prepared data end to end: the CLI prepares, ranks train and report val_loss;
and (deselected by default) a rank's memory stays flat on a corpus of a few hundred MB."""

from __future__ import annotations

import json
import math

import pytest

from europa.cli.app import run
from europa.core.data import load_documents
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

VALIDATED = [
    "training.steps=2",
    "data.validation_fraction=0.2",
    "metrics.eval_every=1",
    "metrics.eval_sequences=3",  # not a multiple of the 2 ranks: padding is weighted out
    "metrics.log_every=5",  # evaluations are recorded even on steps that are not logged
]


@pytest.mark.distributed
def test_prepared_and_text_paths_train_alike_and_report_val_loss_on_schedule(tmp_path, capsys):
    text = tmp_path / "text"
    text.mkdir()
    chapters = load_documents()
    (text / "a.txt").write_text("\n\n".join(chapters[:100]))
    (text / "b.txt").write_text("\n\n".join(chapters[100:]))
    prepared = tmp_path / "prepared"
    code = run(["data", "prepare", str(text), "--out", str(prepared), "--workers", "2",
                "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    runs = [
        Run("text", [*VALIDATED, f"data.path='{text}'"]),
        Run("prepared", [*VALIDATED, f"data.path='{prepared}'"]),
    ]
    records = run_ranks(train_runs, 2, str(tmp_path / "runs"), runs, timeout=300)[0]

    assert _same_course(records)
    text_records = records["text"]
    assert [r["step"] for r in text_records] == [1, 2]  # evaluations every step, to the end
    for record in text_records:
        assert record["val_perplexity"] == pytest.approx(math.exp(record["val_loss"]))
    summary = json.loads((tmp_path / "runs" / "text" / "summary.json").read_text())
    assert summary["val_loss"] == text_records[-1]["val_loss"]
    assert len(list((tmp_path / "runs" / "text" / "cache").glob("text-*"))) == 1
    assert not list((tmp_path / "runs" / "prepared" / "cache").glob("text-*"))  # only the split


def _same_course(records: dict[str, list[dict]]) -> bool:
    """Equal losses and validation losses (step times differ)."""
    keys = ("step", "loss", "val_loss", "grad_norm")
    pick = [[{k: r.get(k) for k in keys} for r in records[name]] for name in ("text", "prepared")]
    return pick[0] == pick[1]


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]) * 1024


def _open_rank(folder, cache) -> object:
    """What a rank does at start (rank 0 has written the split cache): open, split, batches."""
    from europa.core.data import RankBatches
    from europa.core.data.shards import PreparedCorpus
    from europa.core.data.split import cached_split
    from europa.core.data.windows import TokenWindows

    corpus = PreparedCorpus(folder, "data.path")
    kept, _ = cached_split(corpus, 0.01, cache, build=False)
    return RankBatches(TokenWindows(corpus, 1024, kept), batch_size=8, dp_rank=3, dp_world=8)


@pytest.mark.large
@pytest.mark.slow
def test_resident_memory_stays_flat_on_a_corpus_of_hundreds_of_megabytes(tmp_path):
    # 400 MB of tokens against 4 MB: a rank opens either the same way, draws 200 batches (its
    # share of a global batch of 64 sequences of 1024 tokens) and its resident memory grows by
    # what it reads, not by the corpus.
    import subprocess
    import sys

    from europa.core.data.synthetic import write_synthetic_corpus

    growth = {}
    for name, size in (("small", 4 * 2**20), ("big", 400 * 2**20)):
        folder, cache = tmp_path / name, tmp_path / f"{name}-cache"
        write_synthetic_corpus(folder, size // 2, shard_tokens=2**25)
        subprocess.run(  # rank 0's one-off pass over the document index, in its own process
            [sys.executable, "-c", "import sys; from europa.core.data.shards import "
             "PreparedCorpus as P; from europa.core.data.split import cached_split as c; "
             "c(P(sys.argv[1], 'data.path'), 0.01, __import__('pathlib').Path(sys.argv[2]), True)",
             str(folder), str(cache)], check=True)  # fmt: skip
        before = _resident_bytes()
        batches = _open_rank(folder, cache)
        opened = _resident_bytes()
        for step in range(200):
            batches.batch(step)
        growth[name] = (opened - before, _resident_bytes() - before)
    small, big = growth["small"], growth["big"]
    assert big[0] < 2 * 2**20, growth  # opening: a few small arrays, whatever the corpus size
    assert big[1] < small[1] + 4 * 2**20, growth  # reading: what 1600 windows need
