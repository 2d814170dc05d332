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


@pytest.mark.large
@pytest.mark.slow
def test_resident_memory_stays_flat_on_a_corpus_of_hundreds_of_megabytes(tmp_path):
    # 400 MB of tokens: a rank maps it, draws batches (each one rank's share of a global batch of
    # 64 sequences) and evaluates; its resident memory grows by what it reads, not by the corpus.
    from europa.core.data import RankBatches
    from europa.core.data.shards import PreparedCorpus
    from europa.core.data.split import split_segments
    from europa.core.data.synthetic import write_synthetic_corpus
    from europa.core.data.windows import TokenWindows

    corpus_bytes = 400 * 2**20
    write_synthetic_corpus(tmp_path / "big", corpus_bytes // 2, shard_tokens=2**25)
    before = _resident_bytes()
    corpus = PreparedCorpus(tmp_path / "big", "data.path")
    kept, _ = split_segments(corpus, 0.01)
    windows = TokenWindows(corpus, 1024, kept)
    batches = RankBatches(windows, batch_size=8, dp_rank=3, dp_world=8, seed=1)
    after_open = _resident_bytes()
    for step in range(200):
        batches.batch(step)
    after_reading = _resident_bytes()
    assert after_open - before < 8 * 2**20, after_open - before
    assert after_reading - before < 32 * 2**20, after_reading - before  # 1600 windows read
