"""The data layer: embedded assets, document loading, packing and per-rank batches."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from europa.core.data import (
    EOS_TOKEN,
    DataError,
    PackedSequences,
    RankBatches,
    load_documents,
    load_tokenizer,
)
from europa.core.data.permutation import epoch_order
from europa.core.seeds import MAX_SEED

EXPECTED_PATH = "expected a .txt file, a .jsonl file or a directory containing them"
EXPECTED_LINE = 'expected one JSON object per line with a string "text" field'
EXPECTED_TOKENIZER = (
    f"expected a tokenizer.json file saved by the `tokenizers` library, with a {EOS_TOKEN} token"
)
SAMPLES = [
    "In the beginning God created the heaven and the earth.",
    "  leading and trailing spaces  ",
    "Tabs\tand\nnew lines,\n\n\tparagraphs; punctuation: (a) [b] 'c' \"d\" -- 42% & $3.50!",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def raises_data_error(message: str) -> pytest.RaisesExc:
    assert "\n" not in message
    return pytest.raises(DataError, match=f"^{re.escape(message)}\\Z")


# --- tokenizer ---------------------------------------------------------------------------------


def test_empty_config_value_means_embedded(tokenizer: Tokenizer) -> None:
    assert load_tokenizer("").to_str() == tokenizer.to_str()
    assert load_documents("") == load_documents()


def test_data_error_is_a_value_error() -> None:
    assert issubclass(DataError, ValueError)


def test_embedded_tokenizer_has_the_documented_vocabulary(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == 2048
    assert tokenizer.token_to_id(EOS_TOKEN) == 0
    assert type(tokenizer.pre_tokenizer).__name__ == "ByteLevel"
    assert type(tokenizer.decoder).__name__ == "ByteLevel"


@pytest.mark.parametrize("text", SAMPLES)
def test_embedded_tokenizer_round_trips_samples(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


@settings(deadline=None)
@given(text=st.text(alphabet=st.characters(codec="ascii")))
def test_embedded_tokenizer_round_trips_any_ascii(tokenizer: Tokenizer, text: str) -> None:
    assume(EOS_TOKEN not in text)  # the special token is matched in the input by design
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_load_tokenizer_from_file(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    loaded = load_tokenizer(path)
    assert loaded.encode(SAMPLES[2]).ids == tokenizer.encode(SAMPLES[2]).ids


def test_load_tokenizer_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with raises_data_error(f"data.tokenizer = '{path}': no such file; {EXPECTED_TOKENIZER}"):
        load_tokenizer(path)


def test_load_tokenizer_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"not": "a tokenizer"}\n')
    with pytest.raises(DataError) as caught:
        load_tokenizer(path)
    message = str(caught.value)
    assert message.startswith(f"data.tokenizer = '{path}': cannot load (")
    assert message.endswith(f"); {EXPECTED_TOKENIZER}")
    assert "\n" not in message


def test_load_tokenizer_without_eos(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(path))
    with raises_data_error(
        f"data.tokenizer = '{path}': has no {EOS_TOKEN} token; {EXPECTED_TOKENIZER}"
    ):
        load_tokenizer(path)


# --- documents ---------------------------------------------------------------------------------


def test_embedded_corpus_is_one_document_per_chapter() -> None:
    documents = load_documents()
    assert len(documents) == 187  # Genesis 50 + Exodus 40 + Leviticus 27 + Numbers 36 + Deut. 34
    assert documents[0].startswith("In the beginning God created the heaven and the earth. ")
    assert all(document and "\n" not in document for document in documents)


def test_txt_documents_are_paragraphs(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("\n\nFirst para\nline two\n\n\n  Second  \n \t \nThird\n")
    assert load_documents(path) == ["First para\nline two", "Second", "Third"]
    assert load_documents(str(path)) == load_documents(path)


def test_jsonl_documents_are_text_fields(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    lines = [{"text": "one\n\ntwo", "id": 1}, {"text": "  "}, {"text": " three "}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert load_documents(path) == ["one\n\ntwo", " three "]


def test_directory_documents_in_relative_path_order(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "b.txt").write_text("from b.txt")
    (tmp_path / "a" / "c.jsonl").write_text(json.dumps({"text": "from a/c.jsonl"}))
    (tmp_path / "a" / "b" / "d.TXT").write_text("from a/b/d.TXT\n\nsecond of d")
    (tmp_path / "a" / "ignored.csv").write_text("text\nnot read")
    assert load_documents(tmp_path) == [
        "from a/b/d.TXT",
        "second of d",
        "from a/c.jsonl",
        "from b.txt",
    ]


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "missing.txt"
    with raises_data_error(f"data.path = '{path}': no such file or directory; {EXPECTED_PATH}"):
        load_documents(path)


@pytest.mark.parametrize(("name", "shown"), [("data.csv", ".csv"), ("README", "(none)")])
def test_unsupported_suffix(tmp_path: Path, name: str, shown: str) -> None:
    path = tmp_path / name
    path.write_text("text")
    with raises_data_error(
        f"data.path = '{path}': unsupported file type '{shown}'; {EXPECTED_PATH}"
    ):
        load_documents(path)


def test_directory_without_text_files(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("text")
    with raises_data_error(
        f"data.path = '{tmp_path}': directory has no .txt or .jsonl files; {EXPECTED_PATH}"
    ):
        load_documents(tmp_path)


@pytest.mark.parametrize(
    ("second_line", "problem"),
    [
        ("{not json", "is not valid JSON"),
        ('{"content": "x"}', 'has no string "text" field'),
        ('{"text": 3}', 'has no string "text" field'),
        ('["text"]', 'has no string "text" field'),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, second_line: str, problem: str) -> None:
    (tmp_path / "sub").mkdir()
    file = tmp_path / "sub" / "docs.jsonl"
    file.write_text(f'{{"text": "fine"}}\n\n{second_line}\n')
    with raises_data_error(
        f"data.path = '{tmp_path}': line 3 of '{file}' {problem}; {EXPECTED_LINE}"
    ):
        load_documents(tmp_path)


def test_no_text_at_all(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n \n\t\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with raises_data_error(
        f"data.path = '{tmp_path}': no text found; expected at least one document"
    ):
        load_documents(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with raises_data_error(
        f"data.path = '{path}': '{path}' is not UTF-8 text; expected UTF-8 .txt/.jsonl files"
    ):
        load_documents(path)


# --- packing -----------------------------------------------------------------------------------


def test_stream_is_documents_each_followed_by_eos(tokenizer: Tokenizer) -> None:
    packed = PackedSequences(SAMPLES, tokenizer, seq_len=4)
    expected = [i for text in SAMPLES for i in [*tokenizer.encode(text).ids, 0]]
    assert packed.tokens.tolist() == expected
    assert packed.num_tokens == len(expected)
    assert packed.tokens.dtype == torch.int64
    assert (packed.tokens == 0).sum().item() == len(SAMPLES)


def test_windows_tile_the_stream_without_overlap(tokenizer: Tokenizer) -> None:
    seq_len = 7
    packed = PackedSequences(SAMPLES, tokenizer, seq_len=seq_len)
    assert packed.num_sequences == packed.num_tokens // (seq_len + 1) == len(packed)
    pieces = []
    for i in range(packed.num_sequences):
        inputs, labels = packed[i]
        assert inputs.shape == labels.shape == (seq_len,)
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[1:], labels[:-1])  # labels are inputs shifted by one
        pieces += [inputs, labels[-1:]]
    used = packed.num_sequences * (seq_len + 1)
    assert torch.equal(torch.cat(pieces), packed.tokens[:used])
    assert packed.num_tokens - used < seq_len + 1  # only a partial window is dropped


def test_embedded_corpus_packs(tokenizer: Tokenizer) -> None:
    packed = PackedSequences(load_documents(), tokenizer, seq_len=256)
    assert packed.num_tokens > 150_000
    assert packed.num_sequences == packed.num_tokens // 257


def test_too_little_text(tokenizer: Tokenizer) -> None:
    with raises_data_error(
        "data.path / training.seq_len = 64: the text has 3 tokens (EOS included) but one "
        "sequence needs seq_len + 1 = 65; expected more text or a smaller training.seq_len"
    ):
        PackedSequences(["a b"], tokenizer, seq_len=64)


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True])
def test_bad_seq_len(seq_len: object) -> None:
    with raises_data_error(f"training.seq_len = {seq_len!r}: expected a positive integer"):
        PackedSequences.from_tokens(torch.arange(100), seq_len)  # type: ignore[arg-type]


# --- per-rank batches --------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    """A small packing and a data-parallel layout that it can feed."""
    batch_size = draw(st.integers(1, 4))
    dp_world = draw(st.integers(1, 4))
    seq_len = draw(st.integers(1, 3))
    num_sequences = batch_size * dp_world + draw(st.integers(0, 30))
    tail = draw(st.integers(0, seq_len))  # tokens past the last full window, dropped
    return {
        "seq_len": seq_len,
        "num_tokens": num_sequences * (seq_len + 1) + tail,
        "batch_size": batch_size,
        "dp_world": dp_world,
        "grad_accum_steps": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, MAX_SEED)),
    }


def make_batches(layout: dict, dp_rank: int, **changes: int) -> RankBatches:
    layout = {**layout, **changes}
    # Token t of the stream has value t, so window i starts with i * (seq_len + 1).
    packed = PackedSequences.from_tokens(torch.arange(layout["num_tokens"]), layout["seq_len"])
    return RankBatches(
        packed,
        batch_size=layout["batch_size"],
        dp_rank=dp_rank,
        dp_world=layout["dp_world"],
        grad_accum_steps=layout["grad_accum_steps"],
        seed=layout["seed"],
    )


def batch_indices(batches: RankBatches, step: int, micro: int) -> list[int]:
    inputs, labels = batches.batch(step, micro)
    seq_len = batches.sequences.seq_len
    assert inputs.shape == labels.shape == (batches.batch_size, seq_len)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    indices = (inputs[:, 0] // (seq_len + 1)).tolist()
    assert indices == batches.sequence_indices(step, micro).tolist()
    return indices


def stream(layout: dict, num_positions: int) -> list[int]:
    """Sequence indices in stream order (micro-batch, then rank), for separate per-rank objects.

    Covers at least num_positions positions (whole micro-batches, so possibly a few more).
    """
    ranks = [make_batches(layout, rank) for rank in range(layout["dp_world"])]
    per_micro_batch = layout["batch_size"] * layout["dp_world"]
    order = []
    for micro_batch in range(math.ceil(num_positions / per_micro_batch)):
        step, micro = divmod(micro_batch, layout["grad_accum_steps"])
        for batches in ranks:
            order += batch_indices(batches, step, micro)
    return order


@settings(deadline=None)
@given(layout=layouts())
def test_every_epoch_uses_each_sequence_exactly_once(layout: dict) -> None:
    # Epoch e is stream positions [e * n, (e + 1) * n): every (rank, step, micro) position in it
    # holds a different sequence and together they hold all n. The straddling micro-batch counts
    # its head in epoch e and its tail in epoch e + 1; the dropped tail tokens form no sequence.
    n = layout["num_tokens"] // (layout["seq_len"] + 1)
    order = stream(layout, 3 * n)
    for epoch in range(3):
        assert sorted(order[epoch * n : (epoch + 1) * n]) == list(range(n))


@settings(deadline=None)
@given(layout=layouts())
def test_epochs_follow_the_documented_permutations(layout: dict) -> None:
    n = layout["num_tokens"] // (layout["seq_len"] + 1)
    order = stream(layout, 2 * n)
    for epoch in range(2):
        assert order[epoch * n : (epoch + 1) * n] == epoch_order(n, layout["seed"], epoch).tolist()


@settings(deadline=None)
@given(
    layout=layouts(),
    data=st.data(),
    earlier=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 2)), max_size=8),
)
def test_batches_are_stateless(
    layout: dict, data: st.DataObject, earlier: list[tuple[int, int]]
) -> None:
    rank = data.draw(st.integers(0, layout["dp_world"] - 1))
    step = data.draw(st.integers(0, 200))
    micro = data.draw(st.integers(0, layout["grad_accum_steps"] - 1))
    fresh = make_batches(layout, rank).batch(step, micro)
    used = make_batches(layout, rank)
    for other_step, other_micro in earlier:
        used.batch(other_step, other_micro % layout["grad_accum_steps"])
    again = used.batch(step, micro)
    assert torch.equal(fresh[0], again[0]) and torch.equal(fresh[1], again[1])


@settings(deadline=None)
@given(layout=layouts(), step=st.integers(0, 500), data=st.data())
def test_ranks_agree_on_the_global_order(layout: dict, step: int, data: st.DataObject) -> None:
    # Separately built per-rank objects (as on separate processes) split exactly the batch that a
    # single rank with a dp_world times larger batch would get.
    micro = data.draw(st.integers(0, layout["grad_accum_steps"] - 1))
    world = layout["dp_world"]
    per_rank = [batch_indices(make_batches(layout, rank), step, micro) for rank in range(world)]
    twin = [batch_indices(make_batches(layout, rank), step, micro) for rank in range(world)]
    single = make_batches(layout, 0, dp_world=1, batch_size=layout["batch_size"] * world)
    assert per_rank == twin
    assert [i for indices in per_rank for i in indices] == batch_indices(single, step, micro)


@settings(deadline=None)
@given(
    num_sequences=st.integers(20, 40),
    seeds=st.lists(st.integers(0, MAX_SEED), min_size=2, max_size=2, unique=True),
)
def test_different_seeds_give_different_orders(num_sequences: int, seeds: list[int]) -> None:
    layout = {
        "seq_len": 1,
        "num_tokens": 2 * num_sequences,
        "batch_size": 1,
        "dp_world": 1,
        "grad_accum_steps": 1,
    }
    first, second = (stream({**layout, "seed": seed}, num_sequences) for seed in seeds)
    assert first != second


def test_seeds_that_the_generator_would_fold_together_are_refused() -> None:
    sequences = PackedSequences.from_tokens(torch.arange(64), seq_len=3)
    with pytest.raises(ValueError, match=r"seed = 4294967296: expected an integer between 0"):
        RankBatches(sequences, batch_size=1, dp_rank=0, dp_world=1, seed=2**32)


def test_too_few_sequences_for_a_micro_batch() -> None:
    packed = PackedSequences.from_tokens(torch.arange(50), seq_len=4)  # 10 sequences
    with raises_data_error(
        "data.path: the text gives 10 sequences of training.seq_len = 4 tokens, but each "
        "micro-batch needs 12 (batch_size 3 × 4 data-parallel ranks); expected more text, a "
        "smaller training.seq_len or a smaller training.batch_size"
    ):
        RankBatches(packed, batch_size=3, dp_rank=0, dp_world=4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"dp_rank": 2}, r"dp_rank must be in \[0, 2\), got 2"),
        ({"grad_accum_steps": 0}, "grad_accum_steps must be >= 1, got 0"),
    ],
)
def test_bad_layout_arguments(arguments: dict, message: str) -> None:
    packed = PackedSequences.from_tokens(torch.arange(50), seq_len=4)
    layout = {"batch_size": 2, "dp_rank": 0, "dp_world": 2, **arguments}
    with pytest.raises(ValueError, match=message):
        RankBatches(packed, **layout)


def test_bad_step_or_micro() -> None:
    packed = PackedSequences.from_tokens(torch.arange(50), seq_len=4)
    batches = RankBatches(packed, batch_size=2, dp_rank=0, dp_world=1, grad_accum_steps=2)
    with pytest.raises(ValueError, match="step must be >= 0"):
        batches.batch(-1)
    with pytest.raises(ValueError, match=r"micro must be in \[0, 2\), got 2"):
        batches.batch(0, micro=2)
