"""QK-clip in every layout trains alike: ``tiny`` with Muon and tau = 0.1, which clips heads
in most steps, gives the same losses and the same clipped heads under DDP, FSDP2,
FlexShard with ep = 2 (its optimizer state offloaded, its blocks recomputed), two pipeline
stages and two torchft replica groups; a run resumed
from its step-10 save continues the uninterrupted one bit for bit."""

from __future__ import annotations

import pytest

from tests.europa_core.test_fault_tolerance import Group, lighthouse  # noqa: F401 (fixture)
from tests.trainer_runs import Run, train_runs

STEPS, SAVED, TAU = 20, 10, 0.1
BASE = ['optimizer.name="muon"', "optimizer.qk_clip=true", f"training.steps={STEPS}",
        "training.seq_len=32", f"checkpoint.every={SAVED}"]  # fmt: skip
CLIPPED = [*BASE, f"optimizer.qk_clip_tau={TAU}"]
# 8 sequences a step: 2 data-parallel ranks × 2 × 2 micro-batches, or one pipeline of 2
# ranks reading 4 × 2, or 2 replica groups of one rank reading 2 × 2 each
PER_RANK = ["training.batch_size=2", "training.grad_accum_steps=2"]
FLAT = [*CLIPPED, *PER_RANK]
STAGED = [*CLIPPED, "parallel.pp=2", "training.batch_size=4", "training.grad_accum_steps=2"]
SPILLED = ["parallel.ep=2", "offload.optimizer_state=true", "offload.optimizer_chunk_mib=1",
           'activation_checkpointing.mode="full"']  # fmt: skip
RUNS = [
    Run("ddp", [*FLAT, "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    Run("fsdp2", FLAT),
    Run("pp2", STAGED),
    # FlexShard with ep = 2, its optimizer state offloaded and its blocks recomputed
    Run("flexshard-ep2", [*FLAT, *SPILLED], ["flexshard", "offload"]),
    Run("fsdp2-resumed", FLAT, resume_from="fsdp2"),
    Run("recorded-only", [*BASE, "optimizer.qk_clip_tau=1e9", *PER_RANK]),
]


def _losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows if "loss" in r]


def _clipped(rows: list[dict]) -> list[int]:
    return [r["qk_heads_clipped"] for r in rows if "loss" in r]


def _worst(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))


@pytest.fixture(scope="module")
def layout_records(tmp_path_factory) -> dict[str, list[dict]]:
    from tests.conftest import run_ranks

    root = tmp_path_factory.mktemp("qk-clip-layouts")
    return run_ranks(train_runs, 2, str(root), RUNS, timeout=240)[0]


@pytest.mark.distributed
def test_every_layout_clips_the_same_heads_and_trains_alike(layout_records):
    reference = layout_records["ddp"]
    counts = _clipped(reference)
    assert len(counts) == STEPS
    assert sum(c > 0 for c in counts) >= STEPS * 3 // 4, counts  # heads clip in most steps
    for name in ("fsdp2", "flexshard-ep2", "pp2"):
        assert _clipped(layout_records[name]) == counts, name
        assert _worst(_losses(layout_records[name]), _losses(reference)) <= 1e-5, name
        # every layer's largest logit, the whole model's even where a rank holds some layers
        for mine, theirs in zip(layout_records[name], reference, strict=True):
            assert mine["qk_logit_max"] == pytest.approx(theirs["qk_logit_max"], rel=1e-5)
    # the clip holds the logits: a run that records them but never clips ends far above tau
    unclipped = [r for r in layout_records["recorded-only"] if "loss" in r]
    assert _clipped(unclipped) == [0] * STEPS
    assert min(unclipped[-1]["qk_logit_max"].values()) > 1.5 * TAU
    assert max(reference[-1]["qk_logit_max"].values()) < 1.5 * TAU


@pytest.mark.distributed
def test_a_clipped_run_resumed_continues_bit_for_bit(layout_records):
    resumed = [r for r in layout_records["fsdp2-resumed"] if "loss" in r]
    whole = [r for r in layout_records["fsdp2"] if "loss" in r]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for after, before in zip(resumed[SAVED:], whole[SAVED:], strict=True):
        assert after["loss"] == before["loss"], after["step"]
        assert after["qk_logit_max"] == before["qk_logit_max"], after["step"]
        assert after["qk_heads_clipped"] == before["qk_heads_clipped"], after["step"]


@pytest.mark.distributed
def test_two_replica_groups_clip_the_same_heads_and_end_in_the_same_state(
    tmp_path,
    lighthouse,  # noqa: F811
    layout_records,
):
    overrides = [*FLAT, "fault_tolerance.enabled=true", "parallel.dp_replicate=2",
                 f'fault_tolerance.lighthouse="{lighthouse}"', "fault_tolerance.check_every=5",
                 "metrics.progress=false"]  # fmt: skip
    groups = [Group(i, 2, 1, tmp_path / f"group{i}", overrides) for i in range(2)]
    for group in groups:
        assert group.join(180) == [0], group.run_dir.name
    records = [[r for r in g.records() if "loss" in r and r["committed"]] for g in groups]
    reference = layout_records["ddp"]
    for rows in records:
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert _clipped(rows) == _clipped(reference)
    # each group's loss is its own sequences' mean: the two together are the step's
    mean = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*records, strict=True)]
    assert _worst(mean, _losses(reference)) <= 1e-5
    assert records[0][-1]["state_digest"] == records[1][-1]["state_digest"]
