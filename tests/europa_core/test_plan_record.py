"""A europa config as europa-plan's record of a run: the same model (every parameter
counted alike), the same FLOPs but for what Megatron's convention leaves out, and a
refusal, never a stand-in, for what europa-plan does not price yet."""

from __future__ import annotations

import pytest

from europa.core.errors import ConfigError
from europa.core.job import Job
from europa.core.plan.plan_record import run_record
from europa.core.plan.shapes import ModelShapes
from europa.core.plan.timing import model_flops_per_token
from europa.core.plugins import EuropaPluginManager
from europa.core.session import open_session
from europa.plan.flops import source_flops_per_token
from europa.plan.memory import parameter_count
from europa.plan.plan import plan_run


def _config(preset: str, *overrides: str):
    return open_session(preset, list(overrides), [], EuropaPluginManager())


@pytest.mark.parametrize("preset", ["kimi-k2", "debug"])
def test_the_model_europa_plan_plans_is_the_one_europa_builds(preset):
    config, plugins = _config(preset, "training.dtype='bfloat16'")
    job = Job(config=config, run_dir=".", world_size=8, ranks_per_node=4)
    shapes = ModelShapes.of(plugins.hook.europa_build_model(job=job))
    run = run_record(config, "gh200-jupiter", 8)
    assert parameter_count(run.model) == shapes.counts.total
    m = config.model
    moe_layers = m.n_layers - m.n_dense_layers
    routers = 6 * m.dim * m.num_experts * moe_layers  # europa counts them, Megatron does not
    latent_norms = 6 * m.n_layers * (m.q_lora_rank + m.kv_lora_rank)  # Megatron counts them
    core = model_flops_per_token(shapes, m, config.training.seq_len)
    assert source_flops_per_token(run) == core - routers + latent_norms


def test_the_layout_and_batch_as_europa_runs_them():
    config, _ = _config(
        "kimi-k2", "parallel.ep=8", "parallel.pp=4", "parallel.pp_schedule='interleaved-1f1b'",
        "training.grad_accum_steps=8", "parallel.dp_replicate=2",
    )  # fmt: skip
    run = run_record(config, "gh200-jupiter", 64)
    lay = run.layout
    assert (lay.pp, lay.vp, lay.schedule, lay.dp, lay.ep) == (4, 2, "interleaved", 16, 8)
    assert (lay.dp_kind, lay.dp_shard) == ("hsdp", 8)
    assert run.global_batch == 1 * 8 * 16 and run.micro_batches == 8
    assert run.ep_dispatcher == "deepep"  # ep 8 spans two 4-GPU nodes: the two-level exchange
    assert plan_run(run)["time"]["predicted_step_s"] > 0


@pytest.mark.parametrize(
    ("hardware", "overrides", "plugins", "words"),
    [
        ("cpu", [], [], "--hardware = 'cpu': europa-plan prices only its own GPUs"),
        ("gh200-jupiter", ["training.dtype='float32'"], [], "training.dtype = 'float32'"),
        ("gh200-jupiter", [], ["flexshard"], "does not price flexshard yet"),
    ],
)
def test_what_europa_plan_does_not_price_is_refused(hardware, overrides, plugins, words):
    config, _ = open_session("debug", overrides, plugins, EuropaPluginManager())
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        run_record(config, hardware, 8)
