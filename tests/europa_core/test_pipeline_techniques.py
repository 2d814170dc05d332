"""Pipeline stages on 4 gloo ranks, one spawned group for every run: stages sharded by
core's FSDP2 (or replicated) against FSDP2 alone, and FlexShard with expert parallelism
in each stage, with offload and overlap, against the same layout without stages; each
resumed across a change of ``pp``."""

from __future__ import annotations

import pytest

STEPS, SAVED = 3, 2
SAME_BATCH = ["training.seq_len=64", f"training.steps={STEPS}", f"checkpoint.every={SAVED}"]
# validation through FlexShard's stages at step 2 and at the end (core's: test_pipeline.py)
VALIDATED = ["data.validation_fraction=0.2", "metrics.eval_every=2", "metrics.eval_sequences=3"]
# 16 sequences a step: 4 data-parallel ranks × 1 × 4 micro-batches, or 2 stages of 2
# data-parallel ranks × 2 × 4.
WHOLE = [*SAME_BATCH, "training.batch_size=1", "training.grad_accum_steps=4"]
STAGED = [*SAME_BATCH, "parallel.pp=2", "training.batch_size=2", "training.grad_accum_steps=4"]
EP2 = ["parallel.ep=2"]
FLEX = ["flexshard"]
RECOMPUTED = 'activation_checkpointing.mode="full"'


def _schedule(name: str) -> str:
    return f'parallel.pp_schedule="{name}"'


def _fsdp2_runs():
    from tests.trainer_runs import Run

    four_stages = [*SAME_BATCH, "parallel.pp=4", "training.batch_size=4",
                   "training.grad_accum_steps=4"]  # fmt: skip
    return [
        Run("fsdp4", WHOLE),
        Run("pp2-fsdp2-1f1b", STAGED),
        # replicas beside stages: FSDP2's HSDP on a (2, 1) mesh (DDP would hook the rank
        # module's forward, which stages never run)
        Run("pp2-replicas", [*STAGED, "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        # its reference: replicas alone (DDP over 4), whose gradient norm differs from
        # FSDP2's by 3e-5 relative without any stage (the sums' order)
        Run("replicas4", [*WHOLE, "parallel.dp_replicate=4", "parallel.dp_shard=1"]),
        # the pp=2 checkpoint of step SAVED, resumed on 4 stages (and without stages in
        # test_pipeline.py's 2-rank runs)
        Run("pp4-from-pp2", four_stages, resume_from="pp2-fsdp2-1f1b"),
    ]


def _flexshard_runs():
    from tests.trainer_runs import Run

    whole, staged = [*WHOLE, *VALIDATED], [*STAGED, *VALIDATED]
    return [
        Run("ep2", [*whole, *EP2], FLEX),
        # each schedule the issue names, with a technique beside (neither changes a bit)
        Run(
            "pp2-ep2-1f1b-offload", [*staged, *EP2, "offload.min_tensor_kib=1"], [*FLEX, "offload"]
        ),
        Run("pp2-ep2-interleaved-1f1b", [*staged, *EP2, _schedule("interleaved-1f1b")], FLEX),
        # its paired chunks side by side (two threads, FlexShard's lanes)
        Run(
            "pp2-ep2-dualpipev-overlap",
            [*staged, *EP2, _schedule("dualpipev"), 'parallel.pp_overlap_f_b="on"'],
            [*FLEX, "overlap"],
        ),
        # Split backwards (zbv: input, then weight gradients by autograd.grad, which no
        # accumulate hook sees) with replicas of whole units, and with the reduce-scatter
        # issued asynchronously (overlap) over 2 ranks a stage.
        Run(
            "pp2-replicas-zbv",
            [*staged, "parallel.dp_replicate=2", "parallel.dp_shard=1", _schedule("zbv")],
            FLEX,
        ),
        Run("pp2-overlap-zbv", [*staged, _schedule("zbv")], [*FLEX, "overlap"]),
        # every block recomputed, once for both halves of the split backward, the weights
        # gathered for that recomputation by FlexShard's backward hooks
        *(
            Run(f"pp2-ep2-{name}-recomputed", [*staged, *EP2, _schedule(name), RECOMPUTED], FLEX)
            for name in ("zbv", "dualpipev")
        ),
        # The staged checkpoint of step SAVED resumed without stages, and the other way.
        Run("ep2-from-pp2", [*whole, *EP2], FLEX, resume_from="pp2-ep2-1f1b-offload"),
        Run("pp2-from-ep2", [*staged, *EP2], FLEX, resume_from="ep2"),
    ]


def _relative(curve, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    from tests.conftest import run_ranks
    from tests.trainer_runs import train_runs

    root = tmp_path_factory.mktemp("pipeline-four-ranks")
    runs = [*_fsdp2_runs(), *_flexshard_runs()]
    return Records(run_ranks(train_runs, 4, str(root), runs, timeout=400)[0], root)


class Records(dict):
    """Each run's records by name, and ``root``: the folder of their run directories."""

    def __init__(self, records: dict, root) -> None:
        super().__init__(records)
        self.root = root


def _steps(records, names) -> dict[str, list[dict]]:
    return {name: [r for r in records[name] if "loss" in r] for name in names}


def _assert_follow(steps: dict[str, list[dict]], reference: str, **others: str) -> None:
    """Every run's losses and gradient norms follow ``reference``'s (or, for a run named
    in ``others``, the run named there) within 1e-5 relative (a resumed run's from the
    step after the checkpoint it resumed)."""
    for name, rows in steps.items():
        ref = steps[others.get(name.replace("-", "_"), reference)]
        assert len(ref) == STEPS
        start = SAVED if "-from-" in name else 0
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), name
        # The gradient norm too: Muon's step hardly changes with the gradient's scale, so
        # the losses alone would miss a gradient averaged over the wrong ranks.
        keys = ("loss", "grad_norm", "val_loss") if "val_loss" in ref[-1] else ("loss", "grad_norm")
        for key in keys:
            got = [r[key] for r in rows[start:] if key in r]
            assert got, (name, key)
            worst = _relative(got, [r[key] for r in ref[start:] if key in r])
            assert worst <= 1e-5, (name, key, worst)


def _assert_sent_as_planned(runs, records) -> None:
    """Stage-to-stage bytes, counted at torch's send ops, as planned."""
    from tests.europa_core.test_pipeline import assert_sent_as_planned

    for run in runs:
        if run.name.startswith("pp2-") and run.resume_from is None:
            assert_sent_as_planned(run, records[run.name], world=4)


@pytest.mark.distributed
def test_stages_sharded_by_fsdp2_train_as_fsdp2_alone_does_and_resume_on_4_stages(four_ranks):
    runs = _fsdp2_runs()
    steps = _steps(four_ranks, [r.name for r in runs])
    # one data rank a stage (pp = 4) computes as replicas do, without FSDP2's sums
    same_as_replicas = dict.fromkeys(("pp2_replicas", "replicas4", "pp4_from_pp2"), "replicas4")
    _assert_follow(steps, "fsdp4", **same_as_replicas)
    _assert_sent_as_planned(runs, four_ranks)


@pytest.mark.distributed
def test_flexshard_inside_stages_trains_as_without_stages_with_offload_overlap_and_resume(
    four_ranks,
):
    runs = _flexshard_runs()
    steps = _steps(four_ranks, [r.name for r in runs])
    _assert_follow(steps, "ep2")
    _assert_sent_as_planned(runs, four_ranks)
    assert all(r["offload_bytes_offloaded"] > 0 for r in steps["pp2-ep2-1f1b-offload"])
    assert all(r["overlap_comm_s"] > 0 for r in steps["pp2-ep2-dualpipev-overlap"])
    _assert_stage_spans(four_ranks.root / "pp2-ep2-dualpipev-overlap", micro=4)


def _assert_stage_spans(run_dir, micro: int) -> None:
    """europa-overlap's timeline of a staged run: each traced step, each pipeline rank ran
    a forward of every micro-batch on each of its stages (DualPipeV: stages r and 3 - r)
    and their backwards; the step outside them is its bubble."""
    from europa.overlap.trace import load_timelines

    records = load_timelines(run_dir)
    assert records
    for record in records:
        stages = {(index, action, m) for index, action, m, _, _ in record["stages"]}
        rank = record["rank"] // 2  # pipeline rank: 2 data ranks a stage
        for stage in (rank, 3 - rank):
            assert {(stage, "F", m) for m in range(micro)} <= stages, (record["rank"], stage)
            backwards = {m for index, action, m in stages if index == stage and action in "BI"}
            assert backwards == set(range(micro)), (record["rank"], stage)
        assert all(0 <= start <= end <= record["duration"] for *_, start, end in record["stages"])
        # DualPipeV's paired chunks ran side by side: a forward of one stage and a backward
        # of the other overlap in time (two threads; in turn, no two chunks would)
        forwards = [(a, b) for _, action, _, a, b in record["stages"] if action == "F"]
        backwards = [(a, b) for _, action, _, a, b in record["stages"] if action == "B"]
        assert any(max(a, c) < min(b, d) for a, b in forwards for c, d in backwards), record
