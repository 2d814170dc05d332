"""A ``data.path``-style setting to a prepared corpus: a prepared directory as it is, text
prepared on the fly into the run directory's cache (once: by the launcher or rank 0, before the
other ranks open it), the embedded corpus when the setting is empty."""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from europa.core.data.documents import ASSETS_PACKAGE, DataError
from europa.core.data.shards import FORMAT, PreparedCorpus, is_prepared, tokenizer_hash
from europa.core.data.tokenizer import load_tokenizer
from europa.core.run_dir import CACHE

PREPARING = ".preparing.lock"  # hidden: the cache's text-* are its prepared corpora


def embedded_corpus_file() -> Path:
    return Path(str(resources.files(ASSETS_PACKAGE).joinpath("corpus.txt")))


class CorpusOpener:
    """Opens the corpora of one run; ``build`` says whether this process may write the cache."""

    def __init__(self, tokenizer: str, text_field: str, run_dir: Path, build: bool) -> None:
        self.tokenizer_setting, self.text_field = tokenizer, text_field
        self.cache, self.build = Path(run_dir) / CACHE, build
        self._tokenizer_sha: str | None = None

    def tokenizer_sha256(self) -> str:
        if self._tokenizer_sha is None:
            self._tokenizer_sha = tokenizer_hash(load_tokenizer(self.tokenizer_setting or None))
        return self._tokenizer_sha

    def open(self, value: str, key: str) -> PreparedCorpus:
        if value and is_prepared(value):
            corpus = PreparedCorpus(value, key)
            if self.tokenizer_setting and self.tokenizer_sha256() != corpus.tokenizer_sha256:
                raise DataError(
                    f"data.tokenizer = '{self.tokenizer_setting}': {key} = '{value}' was prepared "
                    f"with another tokenizer (sha256 {corpus.tokenizer_sha256[:12]}); expected "
                    'the same tokenizer, or data.tokenizer = "" to use the corpus\'s own'
                )
            return corpus
        return self._open_text(value, key)

    def _open_text(self, value: str, key: str) -> PreparedCorpus:
        from europa.core.data.prepare import prepare_corpus
        from europa.core.data.sources import find_sources

        inputs = [value] if value else [embedded_corpus_file()]
        sources = find_sources(inputs, key)
        identity = {
            "format": FORMAT,
            "sources": [source.describe() for source in sources],
            "tokenizer_sha256": self.tokenizer_sha256(),
            "text_field": self.text_field,
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        folder = self.cache / f"text-{digest[:16]}"
        if not is_prepared(folder):
            if not self.build:
                raise DataError(
                    f"{key} = '{value}': no prepared copy in '{folder}'; expected rank 0 to "
                    "prepare it before the other ranks open it"
                )
            with _alone_in(self.cache / PREPARING):
                if not is_prepared(folder):  # another job prepared it while this one waited
                    prepare_corpus(
                        inputs,
                        folder,
                        tokenizer=self.tokenizer_setting or None,
                        text_field=self.text_field,
                        input_key=key,
                        tokenizer_key="data.tokenizer",
                        out_key=f"{key} (cache)",
                    )
        return PreparedCorpus(folder, key)


@contextmanager
def _alone_in(lock: Path) -> Iterator[None]:
    """An exclusive lock on ``lock``: jobs sharing a cache (the replica groups of a
    fault-tolerant run, each started by the batch system at once) prepare a corpus one at
    a time, and the later ones find it prepared."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
