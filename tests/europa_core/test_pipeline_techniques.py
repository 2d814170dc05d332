"""Techniques inside pipeline stages: FlexShard with expert parallelism in each stage,
with offload and overlap, against the same layout without stages; 4 gloo ranks, one
spawned group for every run."""

from __future__ import annotations

import pytest

STEPS, SAVED = 4, 2
SAME_BATCH = ["training.seq_len=64", f"training.steps={STEPS}", f"checkpoint.every={SAVED}"]
# 16 sequences a step: 4 data-parallel ranks × 1 × 4 micro-batches, or 2 stages of 2
# data-parallel ranks × 2 × 4.
WHOLE = [*SAME_BATCH, "training.batch_size=1", "training.grad_accum_steps=4"]
STAGED = [*SAME_BATCH, "parallel.pp=2", "training.batch_size=2", "training.grad_accum_steps=4"]
EP2 = ["parallel.ep=2"]
FLEX = ["flexshard"]


def _schedule(name: str) -> str:
    return f'parallel.pp_schedule="{name}"'


def _runs():
    from tests.trainer_runs import Run

    return [
        Run("ep2", [*WHOLE, *EP2], FLEX),
        *(
            Run(f"pp2-ep2-{s}", [*STAGED, *EP2, _schedule(s)], FLEX)
            for s in ("1f1b", "interleaved-1f1b", "dualpipev")
        ),
        Run("pp2-ep2-offload", [*STAGED, *EP2, "offload.min_tensor_kib=1"], [*FLEX, "offload"]),
        Run(
            "pp2-ep2-overlap-dualpipev", [*STAGED, *EP2, _schedule("dualpipev")], [*FLEX, "overlap"]
        ),
        # Split backwards (zbv: input, then weight gradients by autograd.grad, which no
        # accumulate hook sees) with replicas of whole units, and with the reduce-scatter
        # issued asynchronously (overlap) over 2 ranks a stage.
        Run(
            "pp2-replicas-zbv",
            [*STAGED, "parallel.dp_replicate=2", "parallel.dp_shard=1", _schedule("zbv")],
            FLEX,
        ),
        Run("pp2-overlap-zbv", [*STAGED, _schedule("zbv")], [*FLEX, "overlap"]),
        # The staged checkpoint of step SAVED resumed without stages, and the other way.
        Run("ep2-from-pp2", [*WHOLE, *EP2], FLEX, resume_from="pp2-ep2-1f1b"),
        Run("pp2-from-ep2", [*STAGED, *EP2], FLEX, resume_from="ep2"),
    ]


def _relative(curve, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))


@pytest.mark.distributed
def test_flexshard_inside_stages_trains_as_without_stages_with_offload_overlap_and_resume(
    ranks, tmp_path
):
    from tests.europa_core.test_pipeline import assert_sent_as_planned
    from tests.trainer_runs import train_runs

    records = ranks(train_runs, 4, str(tmp_path), _runs(), timeout=300)[0]
    steps = {name: [r for r in rows if "loss" in r] for name, rows in records.items()}
    reference = steps["ep2"]
    assert len(reference) == STEPS
    for name, rows in steps.items():
        start = SAVED if "-from-" in name else 0
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), name
        ref, got = reference[start:], rows[start:]
        # The gradient norm too: Muon's step hardly changes with the gradient's scale, so
        # the losses alone would miss a gradient averaged over the wrong ranks.
        for key in ("loss", "grad_norm"):
            worst = _relative([r[key] for r in got], [r[key] for r in ref])
            assert worst <= 1e-5, (name, key, worst)
    for run in _runs():  # stage-to-stage bytes, counted at torch's send ops, as planned
        if run.name.startswith("pp2-") and run.resume_from is None:
            assert_sent_as_planned(run, records[run.name], world=4)
    assert all(r["offload_bytes_offloaded"] > 0 for r in steps["pp2-ep2-offload"])
    assert all(r["overlap_comm_s"] > 0 for r in steps["pp2-ep2-overlap-dualpipev"])
