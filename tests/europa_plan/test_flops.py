"""FLOPs per token: counted as each published run's source counted them (within 3 % of
its TFLOP/s over its tokens/s), and what the GPUs execute, by kind, with recompute."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.plan import load_runs
from europa.plan.flops import executed_flops, source_flops_per_token
from europa.plan.record import RECOMPUTE_MODULES, Recompute

PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
RUNS = load_runs(PUBLISHED).runs
COUNTED = [r for r in RUNS if r.published.flops_per_token is not None]


def test_every_published_run_with_both_figures_is_checked():
    assert len(COUNTED) == 6  # the Llama 3 405B row gives TFLOP/s but no tokens/s


@pytest.mark.parametrize("run", COUNTED, ids=lambda r: r.id)
def test_flops_per_token_in_the_sources_convention_within_3_percent(run):
    ratio = source_flops_per_token(run) / run.published.flops_per_token
    assert 0.97 <= ratio <= 1.03, ratio


def test_the_exact_counts_of_the_megatron_formula():
    """Megatron's own count at these shapes (GFLOP a token), worked out by hand from
    ``num_floating_point_operations``: DeepSeek-V3 with its MTP module, Kimi-K2, Qwen3."""
    by_id = {r.id: r for r in RUNS}
    expected = {
        "mbridge-26.06-gb200-deepseek-v3-mxfp8-256g": 259.99,
        "mbridge-26.06-gb300-kimi-k2-mxfp8-256g": 204.48,
        "modelzoo-qwen3-235b-h100-256g-bf16-cross-node-ep": 148.03,
        "mbridge-26.04.01-h100-llama3-70b-fp8-64g": 449.24,
    }
    for run_id, gflops in expected.items():
        assert source_flops_per_token(by_id[run_id]) / 1e9 == pytest.approx(gflops, abs=0.01)


def test_automodel_counts_no_mtp_and_an_unpadded_vocabulary():
    deepseek = next(r for r in RUNS if r.model.id == "deepseek-v3")
    megatron = source_flops_per_token(deepseek)
    automodel = source_flops_per_token(
        dataclasses.replace(deepseek, flops_convention="nemo-automodel")
    )
    assert automodel / 1e9 == pytest.approx(249.81, abs=0.01)  # AutoModel's own DSV3 figure
    assert megatron - automodel > 10e9  # the MTP layer and its head


def _with_recompute(run, recompute: Recompute):
    return dataclasses.replace(run, layout=dataclasses.replace(run.layout, recompute=recompute))


MODULES = st.frozensets(st.sampled_from(RECOMPUTE_MODULES), min_size=1)


@given(st.sampled_from(RUNS), MODULES)
def test_recompute_adds_forward_work_and_nothing_else(run, modules):
    """None ≤ selective ≤ full; what recompute adds is at most one more forward, so full
    recompute executes at most 4/3 of the no-recompute GEMMs; without recompute the GEMMs
    are exactly three passes of the forward the model FLOPs count."""
    none = executed_flops(_with_recompute(run, Recompute()))
    some = executed_flops(_with_recompute(run, Recompute(kind="selective", modules=modules)))
    full = executed_flops(_with_recompute(run, Recompute(kind="full")))
    assert none.recompute == 0
    assert none.total <= some.total <= full.total
    assert some.total - none.total == pytest.approx(some.recompute)
    gemms = lambda f: f.dense_gemm + f.expert_gemm  # noqa: E731
    assert gemms(full) <= gemms(none) * 4 / 3 + 1
    assert full.attention == pytest.approx(none.attention * (3.5 + 1) / 3.5)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_executed_flops_match_the_model_count_where_they_count_the_same(run):
    """Without recompute, the GPUs execute the model FLOPs plus what the convention leaves
    out (routers, norms, activations, backward's extra attention pass): a little more,
    never less, and within 10 %."""
    plain = executed_flops(_with_recompute(run, Recompute()))
    counted = source_flops_per_token(dataclasses.replace(run, flops_convention="megatron"))
    assert counted <= plain.total <= 1.1 * counted
