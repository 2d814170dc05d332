"""This rank's training batches and validation share, from ``[data]`` and ``[training]``.

Every corpus is read memory-mapped from prepared shards: ``data.path`` itself when it is a
prepared directory, else the text prepared once into the run directory's cache. The process
that may write the cache (``build``: the launcher, or rank 0) opens first; the others open after
it (``open_rank_batches``), so text is tokenised once per run, not once per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from europa.core.config.schema import EuropaConfig
from europa.core.data import DataError, RankBatches
from europa.core.data.corpora import CorpusOpener
from europa.core.data.shards import PreparedCorpus
from europa.core.data.split import cached_split
from europa.core.data.validation import ValidationBatches
from europa.core.data.windows import TokenWindows
from europa.core.errors import ConfigError, is_user_error, one_line


@dataclass
class Batches:
    source: RankBatches
    tokens_per_step: int  # over all data-parallel ranks
    validation: ValidationBatches | None = None


def build_batches(
    config: EuropaConfig, dp_rank: int, dp_world: int, run_dir: Path, *, build: bool = True
) -> Batches:
    data, t = config.data, config.training
    opener = CorpusOpener(data.tokenizer, data.text_field, run_dir, build)
    corpus = opener.open(data.path, "data.path")
    _check_vocab(config, corpus)
    held_out = None
    if data.validation_fraction > 0:
        if data.validation_path:
            raise ConfigError(
                f"data.validation_fraction = {data.validation_fraction}: expected 0 when "
                f"data.validation_path is set ('{data.validation_path}')"
            )
        kept, out = cached_split(corpus, data.validation_fraction, opener.cache, build)
        train = TokenWindows(corpus, t.seq_len, kept, key="data.validation_fraction")
        held_out = TokenWindows(corpus, t.seq_len, out, key="data.validation_fraction")
    else:
        train = TokenWindows(corpus, t.seq_len)
        if data.validation_path:
            other = opener.open(data.validation_path, "data.validation_path")
            _check_same_tokenizer(corpus, other, data.validation_path)
            held_out = TokenWindows(other, t.seq_len, key="data.validation_path")
    source = RankBatches(
        train,
        batch_size=t.batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        grad_accum_steps=t.grad_accum_steps,
        seed=data.seed,
    )
    validation = None
    if held_out is not None:
        validation = ValidationBatches(
            held_out,
            batch_size=t.batch_size,
            dp_rank=dp_rank,
            dp_world=dp_world,
            count=config.metrics.eval_sequences,
        )
    return Batches(source, t.batch_size * t.seq_len * t.grad_accum_steps * dp_world, validation)


def open_rank_batches(
    config: EuropaConfig, dp_rank: int, dp_world: int, run_dir: Path, is_main: bool
) -> Batches:
    """``build_batches`` on every rank of a process group, rank 0 first (it fills the cache).

    A user error on rank 0 is raised on every rank with rank 0's line, instead of leaving the
    others waiting for a cache that will not come."""
    import torch.distributed as dist

    batches, failure = None, None
    if is_main:
        try:
            batches = build_batches(config, dp_rank, dp_world, run_dir)
        except Exception as err:
            if not is_user_error(err):
                raise
            failure = err
    if dist.is_available() and dist.is_initialized():
        message = [one_line(failure) if failure is not None else None]
        dist.broadcast_object_list(message, src=0)
        if failure is None and message[0] is not None:
            raise DataError(message[0])
    if failure is not None:
        raise failure
    if batches is None:
        batches = build_batches(config, dp_rank, dp_world, run_dir, build=False)
    return batches


def _check_vocab(config: EuropaConfig, corpus: PreparedCorpus) -> None:
    if corpus.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {config.model.vocab_size}: expected at least the "
            f"{corpus.vocab_size} tokens of the tokenizer"
        )


def _check_same_tokenizer(corpus: PreparedCorpus, other: PreparedCorpus, value: str) -> None:
    if other.tokenizer_sha256 != corpus.tokenizer_sha256:
        raise DataError(
            f"data.validation_path = '{value}': tokenised with another tokenizer than data.path "
            f"(sha256 {other.tokenizer_sha256[:12]}, not {corpus.tokenizer_sha256[:12]}); "
            "expected the same tokenizer"
        )
