"""Step time, its compute so far: kernels on a roofline with wave quantisation, one set of
efficiencies per GPU generation, no figure of a run's own source in its prediction."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.plan import load_runs
from europa.plan.comm_time import dp_seconds
from europa.plan.compute_time import compute_by_rank
from europa.plan.kernels import Gemm, gemm_seconds, wave_efficiency
from europa.plan.plan import plan_run
from europa.plan.record import Recompute
from europa.plan.step_time import bubble_share
from tests.europa_plan.runs_toml import runs_toml

PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
RUNS = load_runs(PUBLISHED).runs
DIMS = st.integers(1, 20000)


@given(DIMS, DIMS, st.integers(1, 200))
def test_a_wave_keeps_at_most_every_sm_busy(m, n, sms):
    share = wave_efficiency(m, n, sms)
    assert 0 < share <= 1
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    assert (share == 1) == (tiles % sms == 0)


@given(DIMS, DIMS, DIMS, st.sampled_from([1, 2]))
def test_a_multiply_is_never_faster_than_its_peak_or_its_bytes(m, n, k, in_bytes):
    seconds = gemm_seconds(Gemm(m, n, k), 1000.0, 0.8, 3.0, 132, in_bytes)
    assert seconds >= 2 * m * n * k / 1000e12 / 0.8 * (1 - 1e-12)
    assert seconds >= (m * k + k * n) * in_bytes / 3e12 * (1 - 1e-12)


def test_a_published_figure_changes_no_prediction():
    run = RUNS[0]
    other = dataclasses.replace(
        run, published=dataclasses.replace(run.published, step_s=1.0, tflops_per_gpu=1.0)
    )
    plan, changed = plan_run(run), plan_run(other)
    assert plan["time"]["terms"] == changed["time"]["terms"]
    assert plan["time"]["predicted_step_s"] == changed["time"]["predicted_step_s"]
    assert plan["time"]["published_step_s"] != changed["time"]["published_step_s"]


def test_a_run_planned_alone_is_planned_as_inside_the_file(tmp_path):
    data = tomllib.loads(PUBLISHED.read_text())
    run = next(r for r in data["run"] if r["model"] == "deepseek-v3")
    model = next(m for m in data["model"] if m["id"] == "deepseek-v3")
    gpu = next(g for g in data["gpu"] if g["id"] == run["gpu"])
    alone = tmp_path / "alone.toml"
    alone.write_text(runs_toml(gpu=[gpu], model=[model], run=[run]))
    in_file = next(r for r in RUNS if r.id == run["id"])
    assert plan_run(load_runs(alone).runs[0]) == plan_run(in_file)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_recompute_costs_time_and_nothing_else(run):
    layout = dataclasses.replace(run.layout, recompute=Recompute(kind="full"))
    full = compute_by_rank(dataclasses.replace(run, layout=layout))
    layout = dataclasses.replace(run.layout, recompute=Recompute())
    none = compute_by_rank(dataclasses.replace(run, layout=layout))
    for f, n in zip(full, none, strict=True):
        assert n.recompute == 0 < f.recompute
        assert (f.dense_gemm, f.expert_gemm, f.attention) == (
            n.dense_gemm,
            n.expert_gemm,
            n.attention,
        )


def test_every_run_of_a_generation_takes_the_same_efficiencies():
    by_generation: dict = {}
    for run in RUNS:
        by_generation.setdefault(run.gpu.generation, set()).add(id(run.gpu.efficiencies))
    assert all(len(ids) == 1 for ids in by_generation.values())


@given(st.integers(2, 8), st.integers(1, 4), st.integers(1, 4))
def test_the_simulated_bubble_is_the_schedules_closed_form_when_nothing_travels(pp, vp, rounds):
    """Equal stages and free transfers: 1F1B idles P − 1 micro-batch times, interleaving
    (P − 1)/V; a transfer only ever adds to it."""
    schedule = "interleaved" if vp > 1 else "1f1b"
    layout = dataclasses.replace(RUNS[0].layout, pp=pp, vp=vp, schedule=schedule, dp=1)
    run = dataclasses.replace(RUNS[0], layout=layout, global_batch=pp * rounds)
    share, how = bubble_share(run)
    assert how == "simulated"
    assert share == pytest.approx((pp - 1) / vp, abs=1e-9)
    assert bubble_share(run, transfer=0.05)[0] >= share


def test_a_step_of_millions_of_micro_batches_takes_the_closed_form_without_playing_it():
    layout = dataclasses.replace(RUNS[0].layout, pp=4, vp=1, schedule="1f1b", dp=1)
    run = dataclasses.replace(RUNS[0], layout=layout, global_batch=2**40)
    assert bubble_share(run) == (3, "closed form")


def test_a_shape_the_schedule_refuses_takes_its_closed_form():
    layout = dataclasses.replace(RUNS[0].layout, pp=4, vp=2, schedule="dualpipev", dp=1)
    run = dataclasses.replace(RUNS[0], layout=layout, global_batch=6)  # DualPipeV needs 2·P
    assert bubble_share(run) == (pytest.approx(3 / 6), "closed form")


def test_zero3_gathers_the_weights_again_for_backward_unless_they_are_kept():
    """torch's FSDP2 and Megatron-FSDP gather a micro-batch's weights for its forward and
    again for its backward; Llama 3's FSDP keeps them whole for the step once gathered."""
    run = next(r for r in RUNS if r.id == "automodel-kimi-k2-h100-256g-bf16")
    assert run.layout.dp_kind == "fsdp" and run.reshard_after_forward
    kept = dataclasses.replace(run, reshard_after_forward=False)
    regathered, once = dp_seconds(run), dp_seconds(kept)
    assert regathered.seconds > once.seconds and regathered.exposed >= once.exposed
    ddp = dataclasses.replace(run, layout=dataclasses.replace(run.layout, dp_kind="zero1"))
    assert dp_seconds(ddp) == dp_seconds(dataclasses.replace(ddp, reshard_after_forward=False))
