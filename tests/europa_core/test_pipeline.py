"""Pipeline stages (``europa.core.pipeline``): the balanced cut, a stage's copy of the
model, and torch's schedules on gloo ranks computing the whole model's gradients."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.pipeline.cut import balanced_cut, stage_module_names, stated_cut
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
    from europa.core.pipeline.schedules import build_schedule, stages_of_rank

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
