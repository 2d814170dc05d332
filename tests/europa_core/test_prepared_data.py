"""Prepared corpora: shards decode to their documents, batches equal those from the text,
every sequence once per epoch, held-out documents never trained on, restarts and one-line errors."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from europa.cli.app import run
from europa.core.data import DataError, PackedSequences, RankBatches, load_documents
from europa.core.data.corpora import embedded_corpus_file
from europa.core.data.prepare import prepare_corpus
from europa.core.data.shards import PreparedCorpus, ShardWriter, shard_stem, write_manifest
from europa.core.data.split import split_segments
from europa.core.data.tokenizer import load_tokenizer
from europa.core.data.windows import TokenWindows
from europa.core.errors import ConfigError
from europa.core.session import open_session
from europa.core.train.batches import build_batches

EOS = 0
WORDS = st.text(alphabet="abcdefghij XYZ,.'\t", min_size=1, max_size=12)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def one_line_error(message: str) -> pytest.RaisesExc:
    return pytest.raises(DataError, match=f"^{re.escape(message)}\\Z")


def decoded_documents(corpus: PreparedCorpus, tokenizer: Tokenizer) -> list[str]:
    documents = []
    for index in range(len(corpus.shards)):
        offsets, _ = corpus.document_index(index)
        base = int(corpus.starts[index])
        for start, end in itertools.pairwise(offsets):
            ids = corpus.read(base + int(start), int(end - start)).tolist()
            assert ids[-1] == EOS and EOS not in ids[:-1]
            documents.append(tokenizer.decode(ids[:-1]))
    return documents


def write_inputs(folder: Path, documents: list[str]) -> None:
    """The documents spread over one file of each kind, in name order."""
    folder.mkdir(parents=True, exist_ok=True)
    quarter = -(-len(documents) // 4)
    txt, jsonl, gz, parquet = (documents[i : i + quarter] for i in range(0, 4 * quarter, quarter))
    (folder / "a.txt").write_text("\n \n".join(txt))
    lines = "".join(json.dumps({"body": text}) + "\n\n" for text in jsonl)
    (folder / "b.jsonl").write_text(lines)
    with gzip.open(folder / "c.jsonl.gz", "wt") as file:
        file.write("".join(json.dumps({"body": text}) + "\n" for text in gz))
    pq.write_table(pa.table({"body": parquet}), folder / "d.parquet")


def paragraph(words: list[str]) -> str:
    return " ".join(words).strip() or "x"


# --- preparation -------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(
    documents=st.lists(
        st.lists(WORDS, min_size=1, max_size=6).map(paragraph), min_size=1, max_size=24
    )
)
def test_prepared_shards_decode_back_to_the_documents(tmp_path_factory, tokenizer, documents):
    folder = tmp_path_factory.mktemp("inputs")
    write_inputs(folder, documents)
    out = folder.parent / f"{folder.name}-prepared"
    manifest = prepare_corpus([folder], out, text_field="body")
    corpus = PreparedCorpus(out, "data.path")
    assert decoded_documents(corpus, tokenizer) == documents
    assert manifest["documents"] == len(documents)
    assert corpus.num_tokens == manifest["tokens"] == sum(s.tokens for s in corpus.shards)
    assert [Path(s["path"]).name for s in manifest["shards"]] == [
        "a.txt",
        "b.jsonl",
        "c.jsonl.gz",
        "d.parquet",
    ]


def test_embedded_corpus_prepares_to_the_in_memory_stream(tmp_path, tokenizer):
    prepare_corpus([embedded_corpus_file()], tmp_path / "bible")
    corpus = PreparedCorpus(tmp_path / "bible", "data.path")
    in_memory = PackedSequences(load_documents(), tokenizer, seq_len=128).tokens
    assert torch.equal(torch.from_numpy(corpus.read(0, corpus.num_tokens)), in_memory)
    assert corpus.dtype == np.uint16


LAYOUT = st.fixed_dictionaries(
    {
        "seq_len": st.integers(1, 12),
        "batch_size": st.integers(1, 3),
        "dp_world": st.integers(1, 4),
        "grad_accum_steps": st.integers(1, 2),
        "seed": st.integers(0, 2**31 - 1),
    }
)


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A folder of .txt/.jsonl text and its prepared copy (two files: windows cross shards)."""
    folder = tmp_path_factory.mktemp("text")
    documents = load_documents()[:12]
    (folder / "a.txt").write_text("\n\n".join(documents[:7]))
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[7:]))
    prepare_corpus([folder], folder.parent / "prepared")
    return folder, folder.parent / "prepared"


@settings(max_examples=12, deadline=None)
@given(layout=LAYOUT, steps=st.lists(st.integers(0, 400), min_size=1, max_size=4))
def test_batches_from_prepared_shards_equal_those_from_the_text(
    tokenizer, text_corpus, layout, steps
):
    text, prepared = text_corpus
    seq_len = layout.pop("seq_len")
    in_memory = PackedSequences(load_documents(text), tokenizer, seq_len)
    mapped = TokenWindows(PreparedCorpus(prepared, "data.path"), seq_len)
    assert mapped.num_sequences == in_memory.num_sequences
    for rank in range(layout["dp_world"]):
        a = RankBatches(in_memory, dp_rank=rank, **layout)
        b = RankBatches(mapped, dp_rank=rank, **layout)
        for step in steps:
            for micro in range(layout["grad_accum_steps"]):
                for x, y in zip(a.batch(step, micro), b.batch(step, micro), strict=True):
                    assert torch.equal(x, y)


def test_data_path_as_text_or_prepared_gives_the_same_batches(text_corpus, tmp_path):
    text, prepared = text_corpus
    batches = {}
    for name, path in (("text", text), ("prepared", prepared)):
        config, _ = open_session(
            "tiny", [f"data.path='{path}'", "training.seq_len=16", "training.batch_size=2"]
        )
        built = build_batches(config, dp_rank=1, dp_world=2, run_dir=tmp_path / name)
        batches[name] = [built.source.batch(step) for step in range(5)]
    for a, b in zip(batches["text"], batches["prepared"], strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert len(list((tmp_path / "text" / "cache").glob("text-*"))) == 1
    assert not (tmp_path / "prepared" / "cache").exists()  # a prepared path needs no cache


# --- synthetic corpora: token values name their document ---------------------------------------


def synthetic_corpus(folder: Path, lengths: list[list[int]], hashes: list[int]) -> PreparedCorpus:
    """Shard s holds documents of the given lengths; every token of document d is d + 1."""
    folder.mkdir(parents=True, exist_ok=True)
    records, document = [], 0
    for index, shard_lengths in enumerate(lengths):
        writer = ShardWriter(folder, index, np.dtype("<u2"))
        for length in shard_lengths:
            writer.add([document + 1] * length + [EOS], hashes[document])
            document += 1
        records.append(writer.finish({"source": "synthetic"}))
    write_manifest(folder, records, tokenizer_sha256="synthetic", vocab_size=60000, eos_id=EOS)
    return PreparedCorpus(folder, "data.path")


@st.composite
def synthetic_layouts(draw):
    lengths = draw(st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=4))
    count = sum(len(shard) for shard in lengths)
    hashes = draw(st.lists(st.integers(0, 2**64 - 1), min_size=count, max_size=count))
    return lengths, hashes


def epoch_indices(windows, layout: dict, epochs: int) -> list[int]:
    ranks = [RankBatches(windows, dp_rank=r, **layout) for r in range(layout["dp_world"])]
    per_micro = layout["batch_size"] * layout["dp_world"]
    order = []
    for micro_batch in range(-(-epochs * windows.num_sequences // per_micro)):
        step, micro = divmod(micro_batch, layout["grad_accum_steps"])
        order += [i for rank in ranks for i in rank.sequence_indices(step, micro).tolist()]
    return order


@settings(max_examples=25, deadline=None)
@given(shape=synthetic_layouts(), layout=LAYOUT, world=st.integers(1, 9))
def test_every_prepared_sequence_is_used_once_per_epoch_for_any_world_size(
    tmp_path_factory, shape, layout, world
):
    lengths, hashes = shape
    shards = [[*shard, 40] for shard in lengths]  # at least one window per shard
    corpus = synthetic_corpus(tmp_path_factory.mktemp("c"), shards, hashes + [0] * len(shards))
    windows = TokenWindows(corpus, layout.pop("seq_len"))
    layout.update(dp_world=world, batch_size=1)
    if windows.num_sequences < world:
        return
    n = windows.num_sequences
    order = epoch_indices(windows, layout, 2)
    for epoch in range(2):
        assert sorted(order[epoch * n : (epoch + 1) * n]) == list(range(n))


@settings(max_examples=25, deadline=None)
@given(shape=synthetic_layouts(), fraction=st.floats(0.05, 0.5), seq_len=st.integers(1, 6))
def test_held_out_documents_never_appear_in_training_batches(
    tmp_path_factory, shape, fraction, seq_len
):
    lengths, hashes = shape
    lengths = [[length + 1 for length in shard] for shard in lengths]  # every document has a token
    corpus = synthetic_corpus(tmp_path_factory.mktemp("c"), lengths, hashes)
    flat = [length for shard in lengths for length in shard]
    held = {d + 1 for d, h in enumerate(hashes) if h < fraction * 2.0**64}
    kept, out = split_segments(corpus, fraction)
    streams = []
    for segments in (kept, out):
        pieces = [corpus.read(int(start), int(length)) for start, length in segments]
        streams.append(np.concatenate(pieces).tolist() if pieces else [])
    expected = [
        [t for d, n in enumerate(flat) if (d + 1 in held) == side for t in [d + 1] * n + [EOS]]
        for side in (False, True)
    ]
    assert streams == expected
    if len(streams[0]) < 2 * (seq_len + 1):
        return
    windows = TokenWindows(corpus, seq_len, kept, key="data.validation_fraction")
    layout = {"batch_size": 2, "dp_world": 1, "grad_accum_steps": 1, "seed": 3}
    trained = set()
    for step in range(windows.num_sequences):
        trained |= set(RankBatches(windows, dp_rank=0, **layout).batch(step)[0].flatten().tolist())
    assert not trained & held


# --- restarts and refusals ---------------------------------------------------------------------


def test_restart_keeps_complete_shards_and_redoes_the_rest(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for name in "abc":
        (folder / f"{name}.txt").write_text(f"document {name}\n\nanother {name}")
    out = tmp_path / "out"
    prepare_corpus([folder], out)
    kept_mtime = (out / "shard-00000.bin").stat().st_mtime_ns
    (out / "shard-00001.json").unlink()  # as if killed before shard 1 completed
    (out / "shard-00001.bin").write_bytes(b"partial")
    (folder / "c.txt").unlink()
    manifest = prepare_corpus([folder], out)
    assert (out / "shard-00000.bin").stat().st_mtime_ns == kept_mtime
    assert len(manifest["shards"]) == 2 and not list(out.glob(f"{shard_stem(2)}*"))
    assert decoded_documents(PreparedCorpus(out, "data.path"), load_tokenizer()) == [
        "document a",
        "another a",
        "document b",
        "another b",
    ]


def test_refuses_to_mix_tokenizers_in_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    other = Tokenizer.from_str(load_tokenizer().to_str())
    other.add_tokens(["<extra>"])
    other.save(str(tmp_path / "other.json"))
    assert run(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    code = run(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"),
                "--tokenizer", str(tmp_path / "other.json"), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert re.fullmatch(
        rf"europa: error: --out = '{re.escape(str(tmp_path / 'o'))}': holds shards of another "
        r"tokenizer \(sha256 \w{12}, this one \w{12}\); expected the same tokenizer or a new "
        r"directory",
        err,
    )


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("empty.txt", b"\n \n", "no text found; expected at least one document"),
        ("bad.jsonl.gz", b"\x1f\x8b\x08garbage", "cannot be read"),
        ("latin.txt", "caf\xe9".encode("latin-1"), "is not UTF-8 text"),
        ("bad.parquet", b"PAR1 not parquet", "cannot be read"),
    ],
)
def test_empty_or_unreadable_input_is_one_line_and_exit_2(tmp_path, capsys, name, content, problem):
    (tmp_path / name).write_bytes(content)
    out = str(tmp_path / "o")
    code = run(["data", "prepare", str(tmp_path / name), "--out", out, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and problem in err, err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "d.parquet")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"reading \.parquet needs pyarrow; expected `pip install"):
        prepare_corpus([tmp_path / "d.parquet"], tmp_path / "o")


def test_a_truncated_shard_is_refused_in_one_line(text_corpus, tmp_path, capsys):
    _, prepared = text_corpus
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in prepared.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    size = (damaged / "shard-00001.bin").stat().st_size
    os.truncate(damaged / "shard-00001.bin", size - 2)
    with one_line_error(
        f"data.path = '{damaged}': shard 'shard-00001.bin' is truncated or damaged ({size - 2} "
        f"bytes); expected {size} bytes as its manifest says (prepare the corpus again)"
    ):
        PreparedCorpus(damaged, "data.path")


def test_a_vocabulary_larger_than_the_model_is_refused(text_corpus, tmp_path):
    _, prepared = text_corpus
    config, _ = open_session("tiny", [f"data.path='{prepared}'", "model.vocab_size=1000"])
    with pytest.raises(ConfigError, match=r"^model.vocab_size = 1000: expected at least the 2048 "):
        build_batches(config, dp_rank=0, dp_world=1, run_dir=tmp_path)


def test_validation_from_both_a_path_and_a_fraction_is_refused(text_corpus, tmp_path):
    text, prepared = text_corpus
    config, _ = open_session(
        "tiny",
        [
            f"data.path='{prepared}'",
            f"data.validation_path='{text}'",
            "data.validation_fraction=0.1",
        ],
    )
    with pytest.raises(ConfigError, match=r"^data.validation_fraction = 0.1: expected 0 when"):
        build_batches(config, dp_rank=0, dp_world=1, run_dir=tmp_path)


def _open_embedded(run_dir: str) -> str:
    from europa.core.data.corpora import CorpusOpener

    return str(CorpusOpener("", "text", Path(run_dir), build=True).open("", "data.path").path)


def test_jobs_sharing_a_cache_prepare_its_text_one_at_a_time(tmp_path):
    """The replica groups of a fault-tolerant run, started at once by a batch system, each
    prepare the run's text into the cache they share: they take turns, and the later ones
    find it prepared (at once, they wrote the same staged files: FileNotFoundError)."""
    from tests.conftest import _context

    with _context().Pool(3) as pool:
        folders = pool.map(_open_embedded, [str(tmp_path)] * 3)
    assert len(set(folders)) == 1
    assert [p.name for p in (tmp_path / "cache").glob("text-*") if p.is_dir()] == [
        Path(folders[0]).name
    ]
    assert not list(Path(folders[0]).glob("*.partial"))
