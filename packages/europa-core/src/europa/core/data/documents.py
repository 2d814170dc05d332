"""Reading training text: the embedded corpus, or a user's .txt/.jsonl files."""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path

from europa.core.errors import EuropaError

ASSETS_PACKAGE = "europa.core.data.assets"
SUFFIXES = (".txt", ".jsonl")
_EXPECTED_PATH = "a .txt file, a .jsonl file or a directory containing them"
_EXPECTED_LINE = 'one JSON object per line with a string "text" field'
_BLANK_LINE = re.compile(r"\n\s*\n")


class DataError(EuropaError):
    """A problem with the training data or tokenizer, told in one line that names the config key.

    A ValueError, through EuropaError, which the CLI reports without a traceback.
    """


def load_documents(path: str | os.PathLike[str] | None = None) -> list[str]:
    """Read documents; None or "" (the config default) reads the corpus embedded in the package.

    A .txt file gives one document per paragraph (paragraphs are separated by blank lines and
    stripped); a .jsonl file gives one document per non-blank line, from its "text" field; a
    directory gives the documents of every .txt/.jsonl file under it, files taken in the order of
    their relative POSIX paths. Whitespace-only documents are dropped.
    """
    if path is None or path == "":
        corpus = resources.files(ASSETS_PACKAGE).joinpath("corpus.txt").read_text("utf-8")
        return split_paragraphs(corpus)

    root = Path(path)
    if not root.exists():
        raise DataError(
            f"data.path = '{path}': no such file or directory; expected {_EXPECTED_PATH}"
        )
    if root.is_dir():
        files = _data_files(root)
        if not files:
            raise DataError(
                f"data.path = '{path}': directory has no .txt or .jsonl files; "
                f"expected {_EXPECTED_PATH}"
            )
    elif root.suffix.lower() in SUFFIXES:
        files = [root]
    else:
        suffix = root.suffix or "(none)"
        raise DataError(
            f"data.path = '{path}': unsupported file type '{suffix}'; expected {_EXPECTED_PATH}"
        )

    documents = [document for file in files for document in _read_file(file, path)]
    if not documents:
        raise DataError(f"data.path = '{path}': no text found; expected at least one document")
    return documents


def split_paragraphs(text: str) -> list[str]:
    """Split on blank lines (whitespace-only lines count as blank), dropping empty paragraphs."""
    paragraphs = (paragraph.strip() for paragraph in _BLANK_LINE.split(text))
    return [paragraph for paragraph in paragraphs if paragraph]


def _data_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file()]
    return sorted(files, key=lambda file: file.relative_to(root).as_posix())


def _read_file(file: Path, path: str | os.PathLike[str]) -> list[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"data.path = '{path}': '{file}' is not UTF-8 text; expected UTF-8 .txt/.jsonl files"
        ) from error
    if file.suffix.lower() == ".jsonl":
        return _parse_jsonl(text, file, path)
    return split_paragraphs(text)


def _parse_jsonl(text: str, file: Path, path: str | os.PathLike[str]) -> list[str]:
    documents = []
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and similar separators.
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"data.path = '{path}': line {line_number} of '{file}'"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where} is not valid JSON; expected {_EXPECTED_LINE}") from error
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{where} has no string "text" field; expected {_EXPECTED_LINE}')
        if record["text"].strip():
            documents.append(record["text"])
    return documents
