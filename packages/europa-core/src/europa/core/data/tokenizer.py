"""The byte-level BPE tokenizer: the embedded one, or a user's tokenizer.json."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from europa.core.data.documents import ASSETS_PACKAGE, DataError

EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(
    path: str | os.PathLike[str] | None = None, key: str = "data.tokenizer"
) -> Tokenizer:
    """Load a `tokenizers` JSON file; None or "" (the config default) loads the embedded one.

    The tokenizer must know EOS_TOKEN, which PackedSequences puts after every document. ``key``
    is the setting or option named in error messages.
    """
    if path is None or path == "":
        text = resources.files(ASSETS_PACKAGE).joinpath("tokenizer.json").read_text("utf-8")
        return Tokenizer.from_str(text)

    file = Path(path)
    expected = f"a tokenizer.json file saved by the `tokenizers` library, with a {EOS_TOKEN} token"
    if not file.is_file():
        raise DataError(f"{key} = '{path}': no such file; expected {expected}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for unreadable files
        reason = _first_line(str(error))
        raise DataError(f"{key} = '{path}': cannot load ({reason}); expected {expected}") from error
    if tokenizer.token_to_id(EOS_TOKEN) is None:
        raise DataError(f"{key} = '{path}': has no {EOS_TOKEN} token; expected {expected}")
    return tokenizer


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else "unknown error"
