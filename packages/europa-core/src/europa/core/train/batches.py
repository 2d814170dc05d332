"""This rank's training batches, from ``[data]`` and ``[training]``."""

from __future__ import annotations

from dataclasses import dataclass

from europa.core.config.schema import EuropaConfig
from europa.core.data import PackedSequences, RankBatches, load_documents, load_tokenizer
from europa.core.errors import ConfigError


@dataclass
class Batches:
    source: RankBatches
    tokens_per_step: int  # over all data-parallel ranks


def build_batches(config: EuropaConfig, dp_rank: int, dp_world: int) -> Batches:
    tokenizer = load_tokenizer(config.data.tokenizer or None)
    vocab = tokenizer.get_vocab_size()
    if vocab > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {config.model.vocab_size}: expected at least the "
            f"{vocab} tokens of the tokenizer"
        )
    t = config.training
    sequences = PackedSequences(load_documents(config.data.path or None), tokenizer, t.seq_len)
    source = RankBatches(
        sequences,
        batch_size=t.batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        grad_accum_steps=t.grad_accum_steps,
        seed=config.data.seed,
    )
    return Batches(source, t.batch_size * t.seq_len * t.grad_accum_steps * dp_world)
