"""Auxiliary-loss-free load balancing: bias updates and reported load."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from europa.core.config import load_config
from europa.core.model import build_moe_model, update_expert_bias
from europa.core.model.load_balance import moe_layers
from europa.core.model.materialise import materialise


def _model():
    model = build_moe_model(load_config("tiny").model)
    materialise(model, torch.device("cpu"), seed=0)
    return model


counts_strategy = st.lists(st.integers(0, 1000), min_size=8, max_size=8)


@given(counts=counts_strategy)
def test_bias_moves_every_expert_toward_the_mean_and_counts_reset(counts):
    model = _model()
    _, moe = moe_layers(model)[0]
    moe.tokens_per_expert_E.copy_(torch.tensor(counts, dtype=torch.float32))
    before = moe.expert_bias_E.clone()
    load = update_expert_bias(model)
    delta = moe.expert_bias_E - before
    mean = sum(counts) / len(counts)
    assert delta.sum().abs() < 1e-6  # the bias update is centred
    for count, change in zip(counts, delta.tolist(), strict=True):
        if count > mean:
            assert change < 0
        elif count < mean and any(c > mean for c in counts):
            assert change > 0
    assert torch.count_nonzero(moe.tokens_per_expert_E) == 0
    shares = next(iter(load.shares.values()))
    if sum(counts):
        assert sum(shares) == pytest.approx(1.0)
        assert load.imbalance()[moe_layers(model)[0][0]] == pytest.approx(max(counts) / mean)


def test_a_training_forward_counts_top_k_routes_per_token():
    model = _model()
    tokens = torch.randint(0, 2048, (2, 16))
    model(tokens)
    for _, moe in moe_layers(model):
        assert moe.tokens_per_expert_E.sum().item() == 2 * 16 * moe.router.top_k


def _counts_over_ranks(rank, world):
    model = _model()
    for _, moe in moe_layers(model):
        moe.tokens_per_expert_E.fill_(0)
        moe.tokens_per_expert_E[rank] = 10.0  # each rank saw only "its" expert
    load = update_expert_bias(model)
    return next(iter(load.shares.values()))


@pytest.mark.distributed
def test_load_is_summed_over_data_parallel_ranks(ranks):
    shares_by_rank = ranks(_counts_over_ranks, 2)
    expected = [0.5, 0.5] + [0.0] * 6
    assert shares_by_rank == [expected, expected]
