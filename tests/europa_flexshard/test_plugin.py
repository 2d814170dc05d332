"""``europa train -p flexshard``: the plugin through europa's hooks and CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from europa.cli.app import run
from europa.core.model import build_moe_model
from europa.core.session import open_session
from europa.flexshard import plugin
from europa.flexshard.builder import _unit_of_each_parameter, default_units
from europa.spec.plan_layout import unit_of
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

QUIET = ["--set", "metrics.progress=false"]


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _train(run_dir: Path, *args: str) -> None:
    assert run(["train", "--run-dir", str(run_dir), *QUIET, *args]) == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_flexshard_trains_like_fsdp2_and_resumes_on_another_world_size(tmp_path, capfd):
    common = ["training.steps=4", "checkpoint.every=2", 'optimizer.name="muon"',
              "optimizer.lr=0.02", "training.batch_size=2"]  # fmt: skip
    flex = tmp_path / "flex"
    _train(flex, "-p", "flexshard", "--nproc", "2", *(a for c in common for a in ("--set", c)))
    assert "flexshard: 118 whole matrices over 2 rank(s)" in capfd.readouterr().err
    # FSDP2 on the same 2 ranks: what each rank of `europa train` runs, in a spawned group
    fsdp = run_ranks(train_runs, 2, str(tmp_path), [Run("fsdp", common)])[0]["fsdp"]
    assert _losses(flex) == pytest.approx([r["loss"] for r in fsdp], rel=1e-6)

    # The same global batch on one rank, from the 2-rank checkpoint at step 2.
    resumed = tmp_path / "resumed"
    shutil.copytree(flex, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    (resumed / "summary.json").unlink()
    _train(resumed, "--resume", "--nproc", "1", "--set", "training.batch_size=4")
    assert _losses(resumed) == pytest.approx(_losses(flex), rel=1e-6)


def test_a_layout_over_the_memory_limit_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = run(["train", "tiny", "-p", "flexshard", "--nproc", "1", "--run-dir", str(run_dir),
                *QUIET, "--set", "flexshard.max_rank_gib=0.001"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "europa: error: flexshard.max_rank_gib = 0.001: the most loaded of 1 rank(s) would hold "
        "0.03 GiB of parameters, gradients and optimizer state; expected more ranks or a "
        "larger limit"
    ]
    assert not (run_dir / "checkpoints").exists()


def _job(*overrides: str) -> SimpleNamespace:
    config, _ = open_session("tiny", overrides, ["flexshard"])
    return SimpleNamespace(config=config)


def test_the_plan_hook_lays_out_every_parameter_once_with_no_optimizer_traffic():
    job = _job()
    model = build_moe_model(job.config.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = {"parameter_shapes": shapes, "world_size": 4}
    plugin.europa_plan(job=job, plan=plan)
    layout, summary = plan["layout"], plan["flexshard"]
    total = sum(p.numel() for p in model.parameters())
    assert layout["owner"] == "flexshard" and layout["group_size"] == 4
    assert sum(layout["stored_elements"]) == total
    by_rule = zip(layout["muon_elements"], layout["adamw_elements"], strict=True)
    assert [muon + adamw for muon, adamw in by_rule] == layout["stored_elements"]
    assert layout["adamw_tensors"] == len(shapes)  # tiny trains with AdamW
    assert 4 * max(layout["stored_elements"]) == summary["bytes_max"]
    assert summary["bytes_max"] <= 4 * total / 4 + summary["largest_matrix_bytes"]
    assert layout["optimizer_step_gather_elements"] == 0
    assert summary["optimizer_step_bytes_communicated"] == 0


def test_the_plan_hook_and_the_runtime_layout_group_parameters_alike():
    model = build_moe_model(_job().config.model)
    runtime = _unit_of_each_parameter(model, default_units(model))
    assert {name: unit_of(name) for name in runtime} == runtime


def test_the_plugin_module_declares_its_table_with_the_standard_library():
    """Declaring the table loads neither torch nor europa-core: europa lists installed
    plugins' tables without paying for them."""
    import subprocess
    import sys

    probe = (
        "import sys, dataclasses\n"
        "from europa.flexshard import plugin\n"
        "tables = plugin.europa_config_sections()\n"
        "kinds = {type(f.default).__module__ for f in dataclasses.fields(tables['flexshard'])}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'\n"
        "                or m.startswith('europa.core'))\n"
        "print(sorted(tables), sorted(kinds), loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['flexshard']", "['builtins']", "[]"]
    config, _ = open_session("tiny", ["flexshard.reduce_dtype='bfloat16'"], ["flexshard"])
    assert config.section("flexshard").reduce_dtype == "bfloat16"
