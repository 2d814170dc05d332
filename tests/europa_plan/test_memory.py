"""Memory per GPU: every parameter held once across a pipeline's ranks, every layer on
exactly one rank, recompute and sharding only ever give memory back, and every published
run fits its GPU (each ran)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.plan import load_runs
from europa.plan.memory import (
    hbm_gib,
    memory_by_rank,
    parameter_count,
    plan_memory,
    rank_params,
)
from europa.plan.record import RECOMPUTE_MODULES, Recompute
from europa.plan.shapes import padded_vocab
from europa.plan.stages import micro_batches_in_flight, rank_stages

PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
RUNS = load_runs(PUBLISHED).runs
MODELS = load_runs(PUBLISHED).models


@pytest.mark.parametrize(
    ("model", "billions"),
    [("deepseek-v3", 671.0 + 11.6), ("kimi-k2", 1026.4), ("qwen3-235b-a22b", 235.1),
     ("llama3-70b", 70.55), ("llama3-405b", 405.85)],
)  # fmt: skip
def test_parameter_counts_match_the_published_sizes(model, billions):
    """DeepSeek-V3: 671 B and a MTP module of 11.6 B sharing the embedding and head (its
    685 B counts the module's own copies of both); the others as published."""
    assert parameter_count(MODELS[model]) / 1e9 == pytest.approx(billions, abs=0.06)


def _layout(run, **changes):
    return dataclasses.replace(run, layout=dataclasses.replace(run.layout, **changes))


@given(st.sampled_from(RUNS), st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([1, 2, 4]))
def test_every_layer_sits_on_one_rank_and_chunks_differ_by_at_most_one(run, pp, vp):
    n_layers = run.model.n_layers
    if pp * vp > n_layers:
        return
    run = _layout(run, pp=pp, vp=vp, schedule="interleaved" if vp > 1 else "1f1b")
    stages = rank_stages(run)
    held = sorted(i for stage in stages for i in stage.layers)
    assert held == list(range(n_layers))
    sizes = [len(stage.layers) for stage in stages]
    assert max(sizes) - min(sizes) <= vp
    assert stages[0].embedding and stages[-1].head and sum(s.head for s in stages) == 1


@given(st.sampled_from(RUNS))
def test_every_parameter_is_held_once_across_a_pipeline_tp_and_ep(run):
    """Each pipeline rank's dense share times tp, its experts times ep × etp, and its
    routers once add up to the whole model (with Megatron's padded vocabulary)."""
    model, lay = run.model, run.layout
    total = 0.0
    for stage in rank_stages(run):
        p = rank_params(run, stage)
        total += (p.dense + p.embedding) * lay.tp + p.experts * lay.ep * lay.etp + p.replicated
    padding = (padded_vocab(model, lay.tp) - model.vocab_size) * model.dim * 2
    assert total == pytest.approx(parameter_count(model) + padding, rel=1e-9)


@given(st.sampled_from(RUNS), st.frozensets(st.sampled_from(RECOMPUTE_MODULES), min_size=1))
def test_recompute_only_gives_activation_memory_back(run, modules):
    ranks = [
        memory_by_rank(_layout(run, recompute=recompute))
        for recompute in (
            Recompute(),
            Recompute(kind="selective", modules=modules),
            Recompute(kind="full"),
        )
    ]
    for none, some, full in zip(*ranks, strict=True):
        assert full.activations <= some.activations <= none.activations
        assert (none.weights, none.optimizer) == (some.weights, some.optimizer)


@given(st.sampled_from(RUNS))
def test_sharding_the_state_only_gives_memory_back(run):
    ddp, zero1, fsdp = (
        memory_by_rank(_layout(run, dp_kind=kind)) for kind in ("ddp", "zero1", "fsdp")
    )
    for d, z, f in zip(ddp, zero1, fsdp, strict=True):
        assert z.optimizer <= d.optimizer and z.gradients == d.gradients
        assert f.optimizer <= z.optimizer + 1e-9 and f.gradients <= z.gradients
    bf16 = memory_by_rank(dataclasses.replace(run, state_dtype="bfloat16"))
    fp32 = memory_by_rank(dataclasses.replace(run, state_dtype="float32"))
    assert all(b.total < f.total for b, f in zip(bf16, fp32, strict=True))


@given(st.sampled_from(RUNS), st.sampled_from([2, 4, 8]), st.sampled_from([1, 2, 4]))
def test_the_first_rank_holds_the_most_micro_batches(run, pp, vp):
    run = _layout(run, pp=pp, vp=vp, schedule="interleaved" if vp > 1 else "1f1b")
    in_flight = [micro_batches_in_flight(run, r) for r in range(pp)]
    assert in_flight == sorted(in_flight, reverse=True)
    assert in_flight[-1] >= 1 and in_flight[0] <= min(run.micro_batches, pp + (pp - 1) / vp)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_every_published_run_fits_its_gpu(run):
    memory = plan_memory(run)
    assert memory.total <= hbm_gib(run), memory


@given(st.sampled_from(RUNS), st.sampled_from([2, 3, 4, 8]), st.sampled_from(["zbv", "dualpipev"]))
def test_a_v_schedule_holds_the_embedding_and_the_head_on_rank_0(run, pp, schedule):
    """Stage r and 2pp − 1 − r on rank r: the first and the last stage share rank 0."""
    if 2 * pp > run.model.n_layers:
        return
    stages = rank_stages(_layout(run, pp=pp, vp=2, schedule=schedule))
    assert stages[0].embedding and stages[0].head
    assert not any(s.embedding or s.head for s in stages[1:])
    assert sorted(i for s in stages for i in s.layers) == list(range(run.model.n_layers))
    assert set(stages[0].layers) >= {0, run.model.n_layers - 1}
