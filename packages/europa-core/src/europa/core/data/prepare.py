"""``europa data prepare``: tokenise input files into a prepared directory (see ``shards``).

One shard per input file, tokenised in worker processes; a restart keeps every shard whose
completion record matches its file (path, size, modification time), tokenizer and text field.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from tokenizers import Tokenizer
from tqdm import tqdm

from europa.core.data.documents import DataError
from europa.core.data.shards import (
    MANIFEST,
    TOKENIZER,
    ShardWriter,
    completed_shard,
    document_hash,
    token_dtype,
    tokenizer_hash,
    write_atomically,
    write_manifest,
)
from europa.core.data.sources import Source, find_sources, read_documents
from europa.core.data.tokenizer import EOS_TOKEN, load_tokenizer

ENCODE_CHUNK = 1024  # documents per encode_batch call


def prepare_corpus(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    workers: int = 1,
    text_field: str = "text",
    progress: bool = False,
    input_key: str = "INPUT",
    tokenizer_key: str = "--tokenizer",
    out_key: str = "--out",
) -> dict:
    """Prepare ``inputs`` into ``out``; returns the manifest. Keys name the arguments in errors."""
    loaded = load_tokenizer(tokenizer or None, key=tokenizer_key)
    sha = tokenizer_hash(loaded)
    sources = find_sources(inputs, input_key)
    directory = Path(out)
    _claim_directory(directory, loaded, sha, out_key)
    (directory / MANIFEST).unlink(missing_ok=True)  # not a prepared corpus until it is complete

    vocab = loaded.get_vocab_size()
    common = {
        "tokenizer_sha256": sha,
        "text_field": text_field,
        "dtype": token_dtype(vocab).str,
    }
    records: dict[int, dict] = {}
    tasks = []
    for index, source in enumerate(sources):
        expected = {**common, **source.describe()}
        record = completed_shard(directory, index)
        if record is not None and all(record.get(k) == v for k, v in expected.items()):
            records[index] = record
        else:
            tasks.append((index, source, expected))

    total = sum(source.describe()["bytes"] for source in sources)
    kept = sum(record["bytes"] for record in records.values())
    bar = tqdm(total=total, initial=kept, unit="B", unit_scale=True, disable=not progress)
    with bar:
        bar.set_description(f"europa data prepare ({len(records)} of {len(sources)} kept)")
        for index, record in _run(tasks, directory, loaded.to_str(), workers):
            records[index] = record
            bar.update(record["bytes"])

    if sum(record["documents"] for record in records.values()) == 0:
        shown = ", ".join(f"'{given}'" for given in inputs)
        raise DataError(f"{input_key} = {shown}: no text found; expected at least one document")
    _remove_stale_shards(directory, len(sources))
    manifest = write_manifest(
        directory,
        [records[index] for index in range(len(sources))],
        tokenizer_sha256=sha,
        vocab_size=vocab,
        eos_id=loaded.token_to_id(EOS_TOKEN),
        text_field=text_field,
    )
    return manifest


def _claim_directory(directory: Path, tokenizer: Tokenizer, sha: str, out_key: str) -> None:
    """Create ``directory`` and record its tokenizer; refuse one prepared with another."""
    directory.mkdir(parents=True, exist_ok=True)
    recorded = directory / TOKENIZER
    if recorded.is_file():
        try:
            previous = tokenizer_hash(Tokenizer.from_file(str(recorded)))
        except Exception:  # tokenizers raises a bare Exception for an unreadable file
            previous = "unreadable"
        if previous != sha:
            raise DataError(
                f"{out_key} = '{directory}': holds shards of another tokenizer (sha256 "
                f"{previous[:12]}, this one {sha[:12]}); expected the same tokenizer or a new "
                "directory"
            )
        return
    write_atomically(recorded, tokenizer.to_str().encode("utf-8"))


def _run(tasks: list, directory: Path, tokenizer_json: str, workers: int):
    jobs = [(index, source, rec, str(directory), tokenizer_json) for index, source, rec in tasks]
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield job[0], prepare_shard(*job)
        return
    with ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)),
        mp_context=get_context("spawn"),
        initializer=_quiet_worker,
    ) as pool:
        futures = [pool.submit(prepare_shard, *job) for job in jobs]
        for job, future in zip(jobs, futures, strict=True):
            yield job[0], future.result()


def _quiet_worker() -> None:
    # One thread per worker process: the pool already uses the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def prepare_shard(
    index: int, source: Source, record: dict, directory: str, tokenizer_json: str
) -> dict:
    """Tokenise one input file into shard ``index``; returns its completion record."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    writer = ShardWriter(Path(directory), index, record["dtype"])
    try:
        chunk: list[str] = []
        for text in read_documents(source, record["text_field"]):
            chunk.append(text)
            if len(chunk) == ENCODE_CHUNK:
                _encode(tokenizer, chunk, eos_id, writer)
                chunk = []
        _encode(tokenizer, chunk, eos_id, writer)
    except BaseException:
        writer.abandon()
        raise
    return writer.finish(record)


def _encode(tokenizer: Tokenizer, texts: list[str], eos_id: int, writer: ShardWriter) -> None:
    for text, encoding in zip(
        texts, tokenizer.encode_batch(texts, add_special_tokens=False), strict=True
    ):
        writer.add([*encoding.ids, eos_id], document_hash(text))


def _remove_stale_shards(directory: Path, count: int) -> None:
    """Shards of inputs no longer given (a restart with fewer files), and staged leftovers."""
    for path in directory.glob("shard-*"):
        stem = path.name.split(".", 1)[0]
        number = stem.removeprefix("shard-")
        if path.name.endswith(".partial") or (number.isdigit() and int(number) >= count):
            path.unlink(missing_ok=True)
