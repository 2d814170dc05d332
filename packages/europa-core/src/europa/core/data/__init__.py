"""Training data: the embedded corpus and tokenizer, users' text files, prepared (tokenised,
memory-mapped) corpora, packing and batching.

The embedded corpus (five books of the King James Bible) and byte-level BPE tokenizer ship in
`europa.core.data.assets`; nothing is downloaded at run time. The names that need torch are
imported on first use, so `europa data prepare` and its worker processes start without it.
"""

from europa.core.data.documents import DataError, load_documents
from europa.core.data.tokenizer import EOS_TOKEN, load_tokenizer

_NEED_TORCH = {"PackedSequences": "packing", "RankBatches": "packing"}

__all__ = [
    "EOS_TOKEN",
    "DataError",
    "PackedSequences",
    "RankBatches",
    "load_documents",
    "load_tokenizer",
]


def __getattr__(name: str):
    if name in _NEED_TORCH:
        from importlib import import_module

        return getattr(import_module(f"europa.core.data.{_NEED_TORCH[name]}"), name)
    raise AttributeError(f"module 'europa.core.data' has no attribute {name!r}")
