"""Input files of a corpus to prepare: which files, and their documents one at a time.

Documents are the same as ``load_documents`` gives for .txt and .jsonl (a .txt paragraph per
blank-line-separated block, stripped; a .jsonl line's text field), read as a stream so a file
never has to fit in memory; .jsonl.gz is .jsonl compressed, .parquet a column of strings.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from europa.core.data.documents import DataError

SOURCE_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
EXPECTED_INPUT = "a .txt, .jsonl, .jsonl.gz or .parquet file or a directory containing them"
PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class Source:
    """One input file; ``key`` names the setting or argument it came from, for messages."""

    path: Path
    key: str

    @property
    def kind(self) -> str:
        return _suffix(self.path) or ""

    def describe(self) -> dict:
        stat = self.path.stat()
        return {"path": str(self.path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((suffix for suffix in SOURCE_SUFFIXES if name.endswith(suffix)), None)


def find_sources(inputs: Sequence[str | os.PathLike[str]], key: str) -> list[Source]:
    """The files of each input in turn: a file itself, a directory's files under it in the order
    of their relative POSIX paths. One line naming ``key`` on anything missing or unsupported."""
    sources: list[Source] = []
    for given in inputs:
        root = Path(given)
        where = f"{key} = '{given}'"
        if not root.exists():
            raise DataError(f"{where}: no such file or directory; expected {EXPECTED_INPUT}")
        if root.is_dir():
            files = [p for p in root.rglob("*") if _suffix(p) and p.is_file()]
            if not files:
                raise DataError(f"{where}: directory has no input files; expected {EXPECTED_INPUT}")
            files.sort(key=lambda file: file.relative_to(root).as_posix())
        elif _suffix(root):
            files = [root]
        else:
            raise DataError(
                f"{where}: unsupported file type '{root.name}'; expected {EXPECTED_INPUT}"
            )
        sources += [Source(file.resolve(), key) for file in files]
    return sources


def read_documents(source: Source, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, in order; whitespace-only documents are skipped."""
    where = f"{source.key}: '{source.path}'"
    try:
        if source.kind == ".parquet":
            yield from _parquet_documents(source.path, text_field, where)
        elif source.kind == ".txt":
            with open(source.path, encoding="utf-8") as lines:
                yield from paragraphs(lines)
        else:
            opener = gzip.open if source.kind == ".jsonl.gz" else open
            with opener(source.path, "rt", encoding="utf-8") as lines:
                yield from _jsonl_documents(lines, text_field, where)
    except UnicodeDecodeError as error:
        raise DataError(f"{where} is not UTF-8 text; expected UTF-8 text files") from error
    except (OSError, EOFError) as error:  # unreadable, or a corrupt or truncated .gz
        reason = " ".join(str(error).split()) or type(error).__name__
        raise DataError(f"{where} cannot be read ({reason}); expected {EXPECTED_INPUT}") from error


def paragraphs(lines: Iterator[str]) -> Iterator[str]:
    """``split_paragraphs`` on a stream of lines: blocks between whitespace-only lines, stripped."""
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line)
            continue
        text = "".join(block).strip()
        block = []
        if text:
            yield text
    text = "".join(block).strip()
    if text:
        yield text


def _jsonl_documents(lines: Iterator[str], text_field: str, where: str) -> Iterator[str]:
    expected = f'one JSON object per line with a string "{text_field}" field'
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{where}: line {line_number} is not valid JSON; expected {expected}"
            ) from error
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            problem = f'has no string "{text_field}" field'
            raise DataError(f"{where}: line {line_number} {problem}; expected {expected}")
        if record[text_field].strip():
            yield record[text_field]


def _parquet_documents(path: Path, text_field: str, where: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise DataError(
            f"{where}: reading .parquet needs pyarrow; expected "
            "`pip install 'europa-core[parquet]'` or .txt/.jsonl input"
        ) from error
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own ArrowInvalid for a file that is not parquet
        reason = " ".join(str(error).split())
        raise DataError(f"{where} cannot be read ({reason}); expected a parquet file") from error
    if text_field not in table.schema_arrow.names:
        raise DataError(
            f'{where}: has no "{text_field}" column; expected a string column named "{text_field}"'
        )
    row = 0
    for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                problem = f'has no string "{text_field}"'
                raise DataError(f"{where}: row {row} {problem}; expected a string in every row")
            if text.strip():
                yield text
