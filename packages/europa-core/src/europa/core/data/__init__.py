"""Training data: the embedded corpus and tokenizer, users' text files, packing and batching.

The embedded corpus (five books of the King James Bible) and byte-level BPE tokenizer ship in
`europa.core.data.assets`; nothing is downloaded at run time.
"""

from europa.core.data.documents import DataError, load_documents
from europa.core.data.packing import PackedSequences, RankBatches
from europa.core.data.tokenizer import EOS_TOKEN, load_tokenizer

__all__ = [
    "EOS_TOKEN",
    "DataError",
    "PackedSequences",
    "RankBatches",
    "load_documents",
    "load_tokenizer",
]
