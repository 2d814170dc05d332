"""On a GPU europa-plan knows, a plan's time is europa-plan's: bfloat16 compute from its
kernel model fitted on published runs (the same seconds, pipeline rank by pipeline rank,
as ``europa-plan`` gives the same run), its links at the generation's fitted rates;
float32 and profiles of the user's own at the profile's one rate, and the plan says which."""

from __future__ import annotations

import dataclasses

import pytest

from europa.core.errors import ConfigError
from europa.core.plan import load_profile, make_plan, shipped_profiles
from europa.core.plan.hardware import profile_from_table
from europa.core.plan.plan_record import compute_record, run_record
from europa.core.session import open_session
from europa.plan import builtins
from europa.plan.comm_time import dp_seconds
from europa.plan.compute_time import compute_by_rank, rank_compute, state_pass_seconds
from europa.plan.memory import memory_by_rank
from europa.plan.plan import plan_run
from europa.plan.stages import RankStage

BF16 = "training.dtype='bfloat16'"
UNPRICED = "the optimizer step not priced"


@pytest.mark.parametrize(
    "layout",
    [
        ["training.grad_accum_steps=2"],
        ["training.grad_accum_steps=4", "parallel.pp=2"],
        ["training.grad_accum_steps=4", "parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'"],
        ["training.grad_accum_steps=4", "parallel.pp=2", "parallel.pp_schedule='zbv'"],
    ],
)
def test_each_ranks_compute_is_europa_plans_for_the_same_layers(layout):
    """europa cuts stages balanced by FLOPs (``europa.core.pipeline.stages``), Megatron's
    published runs evenly by layer count: europa-plan prices the layers each rank holds."""
    config, manager = open_session("debug", [BF16, *layout], [])
    plan = make_plan(config, manager, load_profile("gh200-jupiter"), 8)
    run = run_record(config, "gh200-jupiter", 8)
    ours = [p.with_overlap.compute_s for p in plan.pipeline_rank_plans or (plan,)]
    held = [r.modules for r in plan.pipeline.ranks] if plan.pipeline else [("lm_head",)]
    theirs = [
        rank_compute(run, _stage(modules, config.model.n_layers, plan.pipeline is None))
        for modules in held
    ]
    assert ours == pytest.approx([t.total * run.micro_batches for t in theirs], rel=1e-12)
    assert plan.step.compute_priced_by.startswith("europa-plan's hopper fit")


def _stage(modules, n_layers: int, whole: bool) -> RankStage:
    layers = [int(m.split(".")[1]) for m in modules if m.startswith("layers.")]
    head = "lm_head" in modules
    return RankStage(0, tuple(range(n_layers)) if whole else tuple(layers), False, head)


def test_stages_cut_alike_take_the_same_compute_as_europa_plan_gives_the_run():
    config, manager = open_session("debug", [BF16, "training.grad_accum_steps=4",
                                             "parallel.pp=2"], [])  # fmt: skip
    plan = make_plan(config, manager, load_profile("gh200-jupiter"), 8)
    run = run_record(config, "gh200-jupiter", 8)
    ours = [p.with_overlap.compute_s for p in plan.pipeline_rank_plans]
    theirs = [terms.total * run.micro_batches for terms in compute_by_rank(run)]
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_links_within_and_across_nodes_are_europa_plans_fitted_rates():
    profile = load_profile("gh200-jupiter")
    gpu = builtins().gpus["gh200-jupiter"]
    eff = gpu.efficiencies
    assert profile.bandwidth("intra_node", "all_to_all") == gpu.nvlink_gbps * 1e9 * eff.nvlink
    assert profile.bandwidth("inter_node", "all_gather") == gpu.network_gbps * 1e9 * eff.network


@pytest.mark.parametrize("name", [n for n in shipped_profiles() if n != "cpu"])
def test_a_shipped_gpu_profile_is_the_gpu_europa_plan_fitted(name):
    profile = load_profile(name)
    gpu = builtins().gpus[profile.fitted_gpu]
    assert profile.gpus_per_node == gpu.gpus_per_node
    assert profile.peak_tflops["bfloat16"] == gpu.peak_tflops["bfloat16"]
    assert profile.peak_tflops["float32"] == gpu.peak_tflops["float32"]


@pytest.mark.parametrize(
    ("hardware", "dtype", "words"),
    [
        (
            "gh200-jupiter",
            "float32",
            "float32 at matmul_efficiency 0.55 of the peak (not fitted); " + UNPRICED,
        ),
        (
            "cpu",
            "float32",
            "float32 at matmul_efficiency 0.7 of the peak (the profile's); " + UNPRICED,
        ),
    ],
)
def test_compute_europa_plan_does_not_fit_is_priced_at_the_profiles_rate_and_says_so(
    hardware, dtype, words
):
    config, manager = open_session("debug", [f"training.dtype='{dtype}'"], [])
    profile = load_profile(hardware)
    plan = make_plan(config, manager, profile, 2)
    assert plan.step.compute_priced_by == words
    flops = plan.model_flops_per_token * plan.tokens_per_step / 2
    rate = profile.peak_flops(dtype) * profile.matmul_efficiency
    assert plan.step.compute_s == pytest.approx(flops / rate)
    assert plan.step.optimizer_s == 0.0


def _table(name: str) -> dict:
    return {k: v for k, v in dataclasses.asdict(load_profile(name)).items() if v is not None}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"intra_node_gbps": 300.0}, "intra_node_gbps = 300.0; expected none with fitted_gpu"),
        ({"fitted_gpu": "a100"}, "fitted_gpu = 'a100'; expected one of europa-plan's GPUs"),
    ],
)
def test_a_profile_naming_a_fitted_gpu_states_no_links_of_its_own(change, words):
    table = _table("h100-sxm")
    for key in ("intra_node_gbps", "inter_node_gbps", "intra_node_efficiency",
                "inter_node_efficiency"):  # fmt: skip
        table.pop(key)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as refused:
        profile_from_table(table | {"fitted_gpu": "h100-sxm"} | change, "mine.toml")
    assert "\n" not in str(refused.value)


def test_a_flexshard_run_is_priced_for_compute_only_never_as_another_layout():
    config, _ = open_session("debug", [BF16], ["flexshard"])
    run = compute_record(config, "gh200-jupiter", 8)
    assert run.layout.dp_kind == "flexshard"
    assert compute_by_rank(run)[0].total > 0
    for whole_run in (memory_by_rank, dp_seconds):
        with pytest.raises(ValueError, match="dp_kind = 'flexshard': europa-plan keeps no model"):
            whole_run(run)


def test_europa_core_and_europa_plan_give_fsdp2_the_same_step():
    """Kimi-K2 with FSDP2 alone on 64 GH200s: the same compute, the same ring collectives
    gathered for each forward and again for each backward, priced alike; what is left is
    europa-plan's optimizer step, which europa-core's plans leave out, and how each
    overlaps (within 1 %)."""
    config, manager = open_session("kimi-k2", [], [])
    plan = make_plan(config, manager, load_profile("gh200-jupiter"), 64)
    theirs = plan_run(run_record(config, "gh200-jupiter", 64))["time"]["predicted_step_s"]
    assert plan.step.step_s == pytest.approx(theirs, rel=0.01)


def test_the_optimizer_step_reads_and_writes_the_ranks_state_once_as_europa_plan_prices_it():
    config, manager = open_session("debug", [BF16], [])
    plan = make_plan(config, manager, load_profile("gh200-jupiter"), 8)
    state = plan.state.totals()[plan.state.most_loaded()]
    expected = state_pass_seconds(2 * state, builtins().gpus["gh200-jupiter"])
    assert plan.step.optimizer_s == pytest.approx(expected) and expected > 0
    step = plan.step
    assert step.step_s == pytest.approx(step.compute_s + step.exposed_s + step.optimizer_s)


def test_europa_overlap_hides_the_context_exchange_behind_the_query_projection_only():
    """cp = 8 over two nodes with the kv exchange, whose every transfer outlasts the query
    projection: europa-overlap hides, per link, the projection's forward of each gather and
    its backward (twice the forward) of each reduce-scatter, its share of the step's FLOPs
    priced at the step's compute; the rest waits, although the step's compute would cover
    it. Without europa-overlap each is waited for at once."""
    cp = ["parallel.cp=8", "training.seq_len=16384", "training.batch_size=1"]
    settings = [BF16, *cp, "parallel.cp_exchange='kv'"]
    exposed = {}
    for plugins in ([], ["overlap"]):
        config, manager = open_session("debug", settings, plugins)
        plan = make_plan(config, manager, load_profile("gh200-jupiter"), 16)
        exposed[bool(plugins)] = plan.step.exposed_s
    m, t = config.model, config.training
    assert config.section("activation_checkpointing").mode == "none" and not m.q_lora_rank
    rows = t.batch_size * t.seq_len // 8 * t.grad_accum_steps
    queries = 2 * m.dim * m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * rows
    forward = plan.step.compute_s * queries * m.n_layers / (plan.model_flops_per_token * rows)
    context = [s for (kind, _), s in plan.step.link_s.items() if kind.startswith("context")]
    assert len(context) == 4 and min(context) > 2 * forward  # intra and inter node
    assert exposed[False] - exposed[True] == pytest.approx(2 * forward + 2 * 2 * forward)
