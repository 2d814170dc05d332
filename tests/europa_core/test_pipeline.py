"""Pipeline stages (``europa.core.pipeline``): the balanced cut, a stage's copy of the
model, and torch's schedules on gloo ranks computing the whole model's gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.pipeline.cut import (
    balanced_cut,
    rank_balanced_cut,
    stage_module_names,
    stated_cut,
)
from europa.core.pipeline.schedules import SCHEDULES

costs_and_stages = st.lists(st.integers(0, 50), min_size=1, max_size=9).flatmap(
    lambda costs: st.tuples(st.just(costs), st.integers(1, len(costs)))
)


@given(costs_and_stages)
@settings(max_examples=200, deadline=None)
def test_the_cut_holds_every_layer_once_in_order_and_its_largest_stage_is_least(case):
    costs, stages = case
    cut = balanced_cut(costs, stages)
    assert len(cut) == stages and all(len(stage) > 0 for stage in cut)
    assert [i for stage in cut for i in stage] == list(range(len(costs)))
    largest = max(sum(costs[i] for i in stage) for stage in cut)
    # every other cut into non-empty consecutive runs: none has a smaller largest stage
    for bounds in itertools.combinations(range(1, len(costs)), stages - 1):
        edges = [0, *bounds, len(costs)]
        other = max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))
        assert largest <= other


def _rank_costs(costs, cut, rank_of) -> dict[int, float]:
    out: dict[int, float] = {}
    for s, stage in enumerate(cut):
        out[rank_of[s]] = out.get(rank_of[s], 0) + sum(costs[i] for i in stage)
    return out


@given(costs_and_stages, st.integers(1, 4), st.booleans())
@settings(max_examples=200, deadline=None)
def test_a_rank_running_several_stages_is_never_busier_than_the_stage_balanced_cut_left_it(
    case, pp, v_shaped
):
    from europa.core.pipeline.stages import stages_of_rank

    costs, _ = case
    per_rank = 2 if v_shaped else max(1, len(costs) // pp // 2)
    if pp * per_rank > len(costs):
        return
    schedule = "zbv" if v_shaped else "interleaved-1f1b"
    rank_of = {s: r for r in range(pp) for s in stages_of_rank(schedule, r, pp, per_rank)}
    order = [rank_of[s] for s in range(pp * per_rank)]
    cut = rank_balanced_cut(costs, order)
    assert len(cut) == len(order) and all(len(stage) > 0 for stage in cut)
    assert [i for stage in cut for i in stage] == list(range(len(costs)))
    balanced = balanced_cut(costs, len(order))
    busiest = max(_rank_costs(costs, cut, order).values())
    assert busiest <= max(_rank_costs(costs, balanced, order).values())


def test_interleaving_six_equal_layers_over_two_ranks_gives_each_three():
    # stage-balanced alone, 2, 1, 2, 1 puts four layers on rank 0 and two on rank 1
    cut = rank_balanced_cut([1.0] * 6, [0, 1, 0, 1])
    assert _rank_costs([1.0] * 6, cut, [0, 1, 0, 1]) == {0: 3.0, 1: 3.0}
    assert max(len(stage) for stage in cut) == 2


def test_a_cut_too_fine_or_stated_wrong_is_refused():
    with pytest.raises(ValueError, match="cannot cut 3 items into 4 non-empty stages"):
        balanced_cut([1, 1, 1], 4)
    with pytest.raises(ValueError, match=r"\[2, 0, 2\]; expected a positive layer count"):
        stated_cut([2, 0, 2], 4)
    with pytest.raises(ValueError, match="summing to the model's 4 layers"):
        stated_cut([2, 1], 4)
    assert stated_cut([1, 3], 4) == [range(0, 1), range(1, 4)]
    names = stage_module_names([range(0, 1), range(1, 4)], ["0", "1", "2", "3"])
    assert names == [["tok_embeddings", "layers.0"],
                     ["layers.1", "layers.2", "layers.3", "norm", "lm_head"]]  # fmt: skip


def _tiny_model(device="cpu"):
    from europa.core.model import build_moe_model
    from europa.core.session import open_session

    config, _ = open_session("tiny", [], [])
    with torch.device("meta"):
        model = build_moe_model(config.model)
    return config, model


def _stages(model, cut):
    from europa.core.model.materialise import materialise
    from europa.core.pipeline.split import split_model

    names = stage_module_names(cut, list(model.layers.keys()))
    out = []
    for keep in names:
        stage = split_model(model, keep)
        materialise(stage, torch.device("cpu"), seed=0)
        out.append(stage)
    return out


def test_the_stages_chained_are_the_whole_model_bit_for_bit():
    from europa.core.model.materialise import materialise

    config, meta = _tiny_model()
    stages = _stages(meta, [range(0, 1), range(1, 3), range(3, 4)])
    whole = _tiny_model()[1]
    materialise(whole, torch.device("cpu"), seed=0)
    params = dict(whole.named_parameters())
    for stage in stages:  # initialised by name: the same values as the whole model's
        for name, p in stage.named_parameters():
            assert torch.equal(p, params[name]), name
    tokens = torch.randint(0, config.model.vocab_size, (2, 16))
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, whole(tokens))


def _schedules_against_whole(rank: int, world: int) -> dict[str, float]:
    from europa.core.model.materialise import materialise
    from europa.core.pipeline.schedules import build_schedule
    from europa.core.pipeline.stages import stages_of_rank

    config, meta = _tiny_model()
    micro, seq = 4, 16
    torch.manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (micro, seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()) / micro

    whole = _tiny_model()[1]
    materialise(whole, torch.device("cpu"), seed=0)
    for m in range(micro):
        loss_fn(whole(inputs[m : m + 1]), labels[m : m + 1]).backward()
    reference = {name: p.grad for name, p in whole.named_parameters()}

    out = {}
    for schedule in SCHEDULES:
        per_rank = 1 if schedule == "1f1b" else 2
        num_stages = world * per_rank
        cut = balanced_cut([1.0] * len(meta.layers), num_stages)
        modules = _stages(meta, cut)
        mine = stages_of_rank(schedule, rank, world, per_rank)
        run, _ = build_schedule(
            schedule, [(i, modules[i]) for i in mine], num_stages, torch.device("cpu"),
            torch.distributed.group.WORLD, micro, loss_fn,
        )  # fmt: skip
        args = (inputs,) if 0 in mine else ()
        last = num_stages - 1 in mine
        run.step(*args, target=labels if last else None, losses=[] if last else None)
        worst = 0.0
        for i in mine:
            for name, p in modules[i].named_parameters():
                ref = reference[name]
                scale = ref.abs().max().clamp_min(1e-12)
                worst = max(worst, float((p.grad - ref).abs().max() / scale))
        out[schedule] = worst
    return out


@pytest.mark.distributed
def test_each_schedule_on_two_ranks_gives_the_whole_models_gradients(ranks):
    for rank, worst in enumerate(ranks(_schedules_against_whole, 2)):
        for schedule, error in worst.items():
            bound = 1e-4 if schedule in ("zbv", "dualpipev") else 1e-5
            assert error <= bound, (rank, schedule, error)


PIPELINE_STEPS, SAVED = 4, 2
SAME_BATCH = [
    "training.seq_len=64",
    f"training.steps={PIPELINE_STEPS}",
    f"checkpoint.every={SAVED}",
    # validation through the stages, every other step: 3 sequences, a padded batch
    "data.validation_fraction=0.2",
    "metrics.eval_every=2",
    "metrics.eval_sequences=3",
]


def _pipeline_runs():
    from tests.trainer_runs import Run

    # 16 sequences a step either way: 2 data-parallel ranks × 2 × 4 micro-batches, or one
    # pipeline of 2 ranks reading 4 × 4.
    reference = Run("pp1", [*SAME_BATCH, "training.batch_size=2", "training.grad_accum_steps=4"])
    staged = [*SAME_BATCH, "parallel.pp=2", "training.batch_size=4", "training.grad_accum_steps=4"]
    runs = [reference]
    for schedule in SCHEDULES:
        runs.append(Run(f"pp2-{schedule}", [*staged, f'parallel.pp_schedule="{schedule}"']))
    # bfloat16 between stages (a stage told float32 received garbage: NaN norms)
    bf16 = 'training.dtype="bfloat16"'
    runs.append(Run("pp1-bf16", [*reference.overrides, bf16]))
    runs.append(Run("pp2-bf16", [*staged, bf16]))
    # A pipeline's checkpoint resumed without stages, and the other way round.
    runs.append(Run("pp1-from-pp2", reference.overrides, resume_from="pp2-1f1b"))
    runs.append(Run("pp2-from-pp1", staged, resume_from="pp1"))
    return runs


@pytest.mark.distributed
def test_pipeline_stages_train_as_the_whole_model_does_and_resume_across_a_change_of_pp(
    ranks, tmp_path
):
    from tests.trainer_runs import train_runs

    records = ranks(train_runs, 2, str(tmp_path), _pipeline_runs(), timeout=300)[0]
    losses = {name: [r["loss"] for r in rows if "loss" in r] for name, rows in records.items()}
    reference = losses["pp1"]
    assert len(reference) == PIPELINE_STEPS
    validated = {name: [r["val_loss"] for r in rows if "val_loss" in r]
                 for name, rows in records.items()}  # fmt: skip
    assert len(validated["pp1"]) == PIPELINE_STEPS // 2
    for schedule in SCHEDULES:
        bound = 1e-4 if schedule in ("zbv", "dualpipev") else 1e-5
        curve = losses[f"pp2-{schedule}"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))
        assert worst <= bound, (schedule, worst, curve, reference)
        val = validated[f"pp2-{schedule}"]  # the same held-out tokens through the stages
        worst = max(abs(a - b) / abs(b) for a, b in zip(val, validated["pp1"], strict=True))
        assert worst <= bound, (schedule, "val_loss", worst)
    bf16 = max(abs(a - b) / abs(b) for a, b in
               zip(losses["pp2-bf16"], losses["pp1-bf16"], strict=True))  # fmt: skip
    # bf16 rounding of two layouts (8.2e-5 here); wrong stage dtypes gave 1.8 % and NaN norms
    assert bf16 <= 2e-3, bf16
    norms = [r["grad_norm"] for r in records["pp2-bf16"] if "grad_norm" in r]
    assert norms and all(math.isfinite(n) for n in norms)
    # resumed from step SAVED (its records up to there kept): the steps after it continue
    # the uninterrupted run's losses
    for resumed in ("pp1-from-pp2", "pp2-from-pp1"):
        steps = [r["step"] for r in records[resumed] if "loss" in r]
        assert steps == list(range(1, PIPELINE_STEPS + 1))
        tail = losses[resumed][SAVED:]
        worst = max(abs(a - b) / abs(b) for a, b in zip(tail, reference[SAVED:], strict=True))
        assert worst <= 1e-5, (resumed, worst)
    # the bytes each pipeline rank's stages sent, counted at torch's send ops, are the
    # plan's, every step and schedule
    for run in _pipeline_runs():
        if "parallel.pp=2" in run.overrides and run.resume_from is None:
            assert_sent_as_planned(run, records[run.name], world=2)
    # each stage's expert loads reach the metrics: every MoE layer of the model
    layers = {
        layer for r in records["pp2-1f1b"] if "expert_load" in r for layer in r["expert_load"]
    }
    assert layers == {
        layer for r in records["pp1"] if "expert_load" in r for layer in r["expert_load"]
    }


RECOMPUTED_STEPS = 8


@pytest.mark.distributed
def test_split_backward_schedules_with_recomputation_train_as_1f1b_without_it(ranks, tmp_path):
    """ZBV and DualPipeV with every block recomputed (``recompute_once``: one recomputation
    for the input and the weight half) against 1F1B keeping its activations, 8 steps."""
    from tests.trainer_runs import Run, train_runs

    staged = [
        "training.seq_len=64",
        f"training.steps={RECOMPUTED_STEPS}",
        "parallel.pp=2",
        "training.batch_size=4",
        "training.grad_accum_steps=4",
        "checkpoint.every=0",
    ]
    recomputed = 'activation_checkpointing.mode="full"'
    runs = [Run("1f1b", staged)] + [
        Run(schedule, [*staged, f'parallel.pp_schedule="{schedule}"', recomputed])
        for schedule in ("zbv", "dualpipev")
    ]
    records = ranks(train_runs, 2, str(tmp_path), runs, timeout=300)[0]
    reference = [r for r in records["1f1b"] if "loss" in r]
    assert len(reference) == RECOMPUTED_STEPS
    for schedule in ("zbv", "dualpipev"):
        rows = [r for r in records[schedule] if "loss" in r]
        for key in ("loss", "grad_norm"):
            got, want = [r[key] for r in rows], [r[key] for r in reference]
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            assert worst <= 1e-5, (schedule, key, worst)


def assert_sent_as_planned(run, rows, world: int) -> None:
    """Each step's ``pipeline_sent_bytes`` of ``run`` equal its plan's, pipeline rank by
    pipeline rank."""
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    config, plugins = open_session(run.preset, run.overrides, run.plugins)
    planned = make_plan(config, plugins, load_profile("cpu"), world).pipeline
    expected = [r.send_bytes for r in planned.ranks]
    counted = [r["pipeline_sent_bytes"] for r in rows if "pipeline_sent_bytes" in r]
    assert counted and all(c == expected for c in counted), (run.name, counted, expected)
    assert all(s > 0 for s in expected), (run.name, expected)


PIPELINE_REFUSALS = [
    (["parallel.pp=8", "training.grad_accum_steps=8"],
     "parallel.pp = 8: expected at most model.n_layers (4) stages in all; 8 ranks × 1 stages"),
    (["parallel.pp=2", "parallel.pp_schedule=\"zbv\"", "parallel.pp_stages_per_rank=3"],
     "parallel.pp_stages_per_rank = 3: expected 2 for zbv"),
    (["parallel.pp=2", "parallel.pp_schedule=\"interleaved-1f1b\"",
      "parallel.pp_stages_per_rank=1"],
     "parallel.pp_stages_per_rank = 1: expected 2 or more for interleaved-1f1b"),
    (["parallel.pp=2", "training.grad_accum_steps=1"],
     "training.grad_accum_steps = 1: expected at least the 2 stages, as 1f1b needs"),
    (["parallel.pp=2", "parallel.pp_schedule=\"dualpipev\"", "training.grad_accum_steps=2"],
     "training.grad_accum_steps = 2: expected at least the 4 stages, as dualpipev needs"),
    (["parallel.pp=2", "training.grad_accum_steps=2", "parallel.pp_layers=[4, 0]"],
     "parallel.pp_layers = [4, 0]: expected 2 positive layer counts, one a stage, summing"),
    (["parallel.pp_layers=[2, 2]"],
     "parallel.pp_layers = [2, 2]: expected empty without pipeline stages"),
    (["parallel.pp_schedule=\"gpipe\""], "parallel.pp_schedule"),
    (["parallel.pp=2", "training.grad_accum_steps=2", "parallel.pp_overlap_f_b=\"on\""],
     "parallel.pp_overlap_f_b = \"on\": expected \"auto\" or \"off\" unless parallel.pp > 1 "
     "with a schedule pairing chunks (dualpipev)"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), PIPELINE_REFUSALS)
def test_a_pipeline_that_cannot_run_is_refused_in_one_line(overrides, message):
    from europa.core.errors import ConfigError
    from europa.core.session import open_session

    with pytest.raises(ConfigError) as err:
        open_session("tiny", overrides, [])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_technique_not_built_for_stages_is_refused_before_any_rank_starts():
    from europa.core.errors import ConfigError
    from europa.core.pipeline.runner import check_pipeline_plugins
    from europa.core.session import open_session

    staged = ["parallel.pp=2", "training.grad_accum_steps=2"]
    config, plugins = open_session("tiny", staged, ["flexshard", "overlap", "offload"])
    check_pipeline_plugins(config, plugins, data_ranks=2)  # test_pipeline_techniques.py
    config, plugins = open_session("tiny", staged, ["overlap"])
    with pytest.raises(ConfigError) as err:
        check_pipeline_plugins(config, plugins, data_ranks=2)
    assert str(err.value) == (
        "parallel.pp = 2 with plugin overlap over core's FSDP2: expected flexshard beside "
        "it; FSDP2's prefetch between pipeline stage parts is not built"
    )


def test_paired_chunks_side_by_side_without_lanes_are_refused_before_any_rank_starts():
    from europa.core.errors import ConfigError
    from europa.core.pipeline.runner import check_pipeline_plugins
    from europa.core.session import open_session

    paired = ["parallel.pp=2", "training.grad_accum_steps=4", 'parallel.pp_schedule="dualpipev"',
              'parallel.pp_overlap_f_b="on"']  # fmt: skip
    check_pipeline_plugins(*open_session("tiny", paired, ["flexshard"]), data_ranks=1)
    with pytest.raises(ConfigError) as err:
        check_pipeline_plugins(*open_session("tiny", paired, []), data_ranks=1)
    assert str(err.value).startswith(
        'parallel.pp_overlap_f_b = "on" without flexshard: expected a layout whose collectives'
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_split_backward_over_fsdp2s_data_ranks_is_refused_before_anything_is_written(
    schedule, tmp_path, capfd
):
    """torch's weight half finds each weight by its gradient accumulator, which FSDP2's
    sharded parameters are not (a KeyError on every rank, once training had begun)."""
    from europa.cli.app import run

    run_dir = tmp_path / "run"
    sets = ["parallel.pp=2", "training.grad_accum_steps=4", f'parallel.pp_schedule="{schedule}"']
    code = run(["train", "tiny", "--nproc", "4", "--run-dir", str(run_dir),
                *(arg for key in sets for arg in ("--set", key))])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.strip() == (
        f'europa: error: parallel.pp_schedule = "{schedule}" with core\'s FSDP2 over 2 '
        "data-parallel ranks a stage: expected -p flexshard, or one data-parallel rank a "
        "stage; torch's split backward finds each weight by its gradient accumulator, which "
        "FSDP2's sharded parameters are not"
    )
    assert not run_dir.exists()
