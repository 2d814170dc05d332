"""QK-clip in the plan: the maxima's one MAX all-reduce over the run's ranks (every
stage's), not overlapped, and, beside a fused attention kernel (a GPU), the causal scores
computed again in each micro-batch's forward; a CPU's block-causal kernel adds no work."""

from __future__ import annotations

import pytest

from europa.core.plan import load_profile, make_plan
from europa.core.plan.plan_record import run_record
from europa.core.session import open_session
from europa.plan.compute_time import attention_flops_seconds
from europa.spec.qk_clip import MAXIMA_TRAFFIC

MUON = ["optimizer.name='muon'", "training.dtype='bfloat16'", "training.grad_accum_steps=2"]
CLIP = [*MUON, "optimizer.qk_clip=true"]


def _plan(overrides, profile: str, world: int):
    config, manager = open_session("debug", overrides, [])
    return config, make_plan(config, manager, load_profile(profile), world)


def _maxima_bytes(plan) -> dict[str, int]:
    return {t.link: t.bytes_per_step for t in plan.traffic if t.kind == MAXIMA_TRAFFIC}


@pytest.mark.parametrize(("world", "links"), [(4, {"intra_node": 1}), (8, None)])
def test_the_maxima_are_one_all_reduce_over_every_rank(world, links):
    config, plan = _plan(CLIP, "h100-sxm", world)
    m = config.model
    whole = 2 * m.n_layers * m.n_heads * 4 * (world - 1) / world  # a ring all-reduce
    assert sum(_maxima_bytes(plan).values()) == pytest.approx(whole, abs=2)
    if links is not None:
        assert set(_maxima_bytes(plan)) == set(links)
    assert all(not t.overlappable for t in plan.traffic if t.kind == MAXIMA_TRAFFIC)
    assert _maxima_bytes(_plan(MUON, "h100-sxm", world)[1]) == {}


def test_stages_reduce_the_maxima_over_the_whole_run():
    config, plan = _plan([*CLIP, "parallel.pp=2"], "cpu", 4)
    m = config.model
    for rank_plan in plan.pipeline_rank_plans:
        assert sum(_maxima_bytes(rank_plan).values()) == pytest.approx(
            2 * m.n_layers * m.n_heads * 4 * 3 / 4, abs=2
        )


def test_beside_a_fused_kernel_each_forward_computes_the_scores_again():
    config, clipped = _plan(CLIP, "h100-sxm", 8)
    _, plain = _plan(MUON, "h100-sxm", 8)
    m, t = config.model, config.training
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    flops = 2 * t.batch_size * m.n_heads * qk * t.seq_len**2 / 2 * m.n_layers
    gpu = run_record(config, "h100-sxm", 8).gpu
    extra = attention_flops_seconds(flops, gpu) * t.grad_accum_steps
    assert clipped.step.compute_s == pytest.approx(plain.step.compute_s + extra, rel=1e-12)
    assert "QK-clip's maxima beside SDPA" in clipped.step.compute_priced_by
    assert extra / plain.step.compute_s < 0.05  # a few per cent of the step's compute


def test_a_cpu_takes_the_maxima_from_its_own_scores():
    _, clipped = _plan(CLIP, "cpu", 2)
    _, plain = _plan(MUON, "cpu", 2)
    assert clipped.step.compute_s == plain.step.compute_s
