"""``parallel.cp`` trains as the same global batch without it: one spawned group of 4 gloo
ranks runs every configuration (``tests.trainer_runs``).

With cp = 1 each of the 4 data-parallel ranks reads 1 sequence a micro-batch; with cp = c,
4 / c groups read c each and cut every sequence over their c ranks, so every run trains the
same 4 sequences a micro-batch."""

from __future__ import annotations

import pytest

STEPS, SAVED = 20, 10
SHORT = 6  # steps of the compositions
# tiny with its dense and one MoE layer: cp acts on each layer alike
TINY = ["model.n_layers=2", "training.seq_len=32", "checkpoint.every=0"]
BASE = [*TINY, f"training.steps={STEPS}"]
SAVES = [f"checkpoint.every={SAVED}"]  # in the runs another resumes
COMPOSED = [*TINY, f"training.steps={SHORT}"]
FLEX = ["flexshard"]


def _cp(cp: int, exchange: str = "latent", per_group: int = 1) -> list[str]:
    """cp ranks a sequence group, which reads ``per_group`` × cp sequences a micro-batch."""
    return [
        f"parallel.cp={cp}",
        f'parallel.cp_exchange="{exchange}"',
        f"training.batch_size={per_group * cp}",
    ]


def _runs():
    from tests.trainer_runs import Run

    staged = [*COMPOSED, "parallel.pp=2", "training.grad_accum_steps=2"]
    return [
        Run("cp1", [*BASE, "training.batch_size=1", *SAVES]),
        Run("cp2-latent", [*BASE, *_cp(2), *SAVES]),
        Run("cp2-kv", [*BASE, *_cp(2, "kv")]),
        Run("cp4-latent", [*BASE, *_cp(4)]),
        # europa-overlap: each gather issued before the query projection, waited after it
        Run("cp4-kv", [*BASE, *_cp(4, "kv")], ["overlap"]),
        # the step-SAVED checkpoints, resumed across a change of cp
        Run("cp1-from-cp2", [*BASE, "training.batch_size=1"], resume_from="cp2-latent"),
        Run("cp2-from-cp1", [*BASE, *_cp(2)], resume_from="cp1"),
        # FlexShard: experts over 2 ranks, ownership over the 4 data-parallel ranks
        Run("ep2", [*COMPOSED, "training.batch_size=1", "parallel.ep=2"], FLEX),
        Run("ep2-cp2", [*COMPOSED, *_cp(2), "parallel.ep=2"], FLEX),
        # two 1F1B stages of 2 data-parallel ranks
        Run("pp2", [*staged, "training.batch_size=2"]),
        Run("pp2-cp2", [*staged, *_cp(2, per_group=2)]),
    ]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from tests.conftest import run_ranks
    from tests.trainer_runs import train_runs

    root = tmp_path_factory.mktemp("context-parallel")
    return run_ranks(train_runs, 4, str(root), _runs(), timeout=400)[0]


def _steps(records, name: str) -> list[dict]:
    return [r for r in records[name] if "loss" in r]


def _assert_same(got: list[dict], want: list[dict], name: str) -> None:
    assert len(got) == len(want) > 0, name
    for key in ("loss", "grad_norm"):
        worst = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, want, strict=True))
        assert worst <= 1e-5, (name, key, worst)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["cp2-latent", "cp2-kv", "cp4-latent", "cp4-kv"])
def test_a_sequence_cut_over_ranks_trains_as_the_whole_sequence(records, name):
    reference = _steps(records, "cp1")
    assert len(reference) == STEPS
    _assert_same(_steps(records, name), reference, name)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "saved_by"), [("cp1-from-cp2", "cp2-latent"), ("cp2-from-cp1", "cp1")]
)
def test_a_checkpoint_resumes_under_another_cp_exactly(records, name, saved_by):
    # metrics.jsonl keeps the saving run's rows up to its checkpoint (truncate_after)
    resumed = [r for r in _steps(records, name) if r["step"] > SAVED]
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))
    _assert_same(resumed, _steps(records, saved_by)[SAVED:], name)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "reference"), [("ep2-cp2", "ep2"), ("pp2-cp2", "pp2")])
def test_context_parallelism_composes_with_experts_and_stages(records, name, reference):
    _assert_same(_steps(records, name), _steps(records, reference), name)


def _sent_per_step(cp: int, features: int) -> int:
    """Each MLA layer gathers a rank's rows in forward and reduce-scatters their gradient
    in backward, each sending them (fp32) to the cp - 1 others."""
    from europa.core.session import open_session

    config, _ = open_session("tiny", TINY, [])
    rows = cp * config.training.seq_len // cp  # cp sequences a group, cut in cp
    return 2 * (cp - 1) * rows * features * 4 * config.model.n_layers


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["cp2-latent", "cp2-kv", "cp4-latent", "cp4-kv"])
def test_each_step_sends_what_its_exchange_gathers(records, name):
    from europa.core.session import open_session

    m = open_session("tiny", TINY, [])[0].model
    features = {
        "latent": m.kv_lora_rank + m.qk_rope_head_dim,
        "kv": m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim),
    }
    cp, exchange = int(name[2]), name.split("-")[1]
    sent = {r["cp_sent_bytes"] for r in _steps(records, name)}
    assert sent == {_sent_per_step(cp, features[exchange])}
    assert all("cp_sent_bytes" not in r for r in _steps(records, "cp1"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["cp2-latent", "cp4-kv"])
def test_the_plan_sends_what_a_step_counted(records, name):
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session
    from europa.spec.plan_layout import CONTEXT_GATHER, CONTEXT_REDUCE_SCATTER

    run = next(r for r in _runs() if r.name == name)
    config, plugins = open_session(run.preset, run.overrides, run.plugins)
    plan = make_plan(config, plugins, load_profile("cpu"), 4)
    kinds = (CONTEXT_GATHER, CONTEXT_REDUCE_SCATTER)
    planned = sum(t.bytes_per_step for t in plan.traffic if t.kind in kinds)
    (counted,) = {r["cp_sent_bytes"] for r in _steps(records, name)}
    assert abs(planned - counted) <= 0.01 * counted, (planned, counted)
