"""The runs file reader: the published runs read as they are, a user's file in the same
format plans the same, and every bad file is refused through the command in one line
(file, table, key, value, what was expected), exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.plan import PlanInputError, load_runs
from tests.europa_plan.runs_toml import RUN, valid_tables, write_runs

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "published_runs.toml"


def europa_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "europa.plan", *map(str, args)], capture_output=True, text=True
    )


def test_the_published_runs_read_with_the_builtins_they_name():
    runs = load_runs(PUBLISHED).runs
    assert len(runs) == 7
    kimi = [r for r in runs if r.model.id == "kimi-k2"]
    assert {r.gpu.id for r in kimi} == {"gb300-nvl72", "h100-sxm"}
    assert kimi[0].model.num_experts == 384 and kimi[0].model.n_dense_layers == 1
    llama = next(r for r in runs if r.id.startswith("llama3-405b"))
    assert "micro_batch" in llama.assumed and llama.layout.dp_kind == "fsdp"
    for run in runs:
        assert run.layout.gpus == run.gpus


def test_a_file_table_replaces_the_builtin_of_its_id(tmp_path):
    tables = valid_tables()
    tables["gpu"][0]["id"] = "h100-sxm"
    tables["gpu"][0]["hbm_gb"] = 99
    tables["run"][0]["gpu"] = "h100-sxm"
    runs = load_runs(write_runs(tmp_path / "runs.toml", **tables))
    assert runs.runs[0].gpu.hbm_gb == 99.0
    assert runs.gpus["gb200-nvl72"].gpus_per_node == 72  # the other built-ins stay


def test_a_users_run_without_published_figures_plans_the_same(tmp_path):
    published = valid_tables()
    published["run"][0].update(
        published={"tokens_per_s_per_gpu": 1000.0, "tflops_per_gpu": 200.0},
        source="a paper",
        quote="| 16 | 2 |",
        notes="derived",
    )
    with_figures = europa_plan(write_runs(tmp_path / "a.toml", **published), "--json")
    without = europa_plan(write_runs(tmp_path / "b.toml", **valid_tables()), "--json")
    assert with_figures.returncode == without.returncode == 0, with_figures.stderr
    plan_a, plan_b = (json.loads(p.stdout)["runs"][0] for p in (with_figures, without))
    assert plan_a["flops_per_token"].pop("source") is not None
    assert plan_a["flops_per_token"].pop("ratio") is not None
    del plan_b["flops_per_token"]["source"], plan_b["flops_per_token"]["ratio"]
    assert plan_a["time"].pop("published_tflops_per_gpu") == 200.0
    for key in ("predicted_tflops_per_gpu", "ratio"):  # what compares with the source
        plan_a["time"].pop(key), plan_b["time"].pop(key, None)
    assert plan_a == plan_b


def _change(table: str, key: str, value):
    def change(tables):
        if value is None:
            del tables[table][0][key]
        else:
            tables[table][0][key] = value

    return change


REFUSALS = {
    "unknown run key": (
        _change("run", "tensor_parallel", 2),
        'run "small-run": unknown key tensor_parallel',
    ),
    "unknown model key": (_change("model", "kv_lora_rank", 512), "unknown key kv_lora_rank"),
    "weights kept without zero-3": (
        _change("run", "reshard_after_forward", False),
        'reshard_after_forward = False: expected no value unless optimizer_sharding = "fsdp"',
    ),
    "more layers than any model": (
        _change("model", "n_layers", 2**40),
        "n_layers = 1099511627776: expected an integer from 1 to 10,000",
    ),
    "unknown gpu key": (_change("gpu", "tdp_w", 700), 'gpu "test-gpu": unknown key tdp_w'),
    "unknown published key": (
        _change("run", "published", {"tokens_per_day": 1.0}),
        "published = {'tokens_per_day': 1.0}: expected no key tokens_per_day",
    ),
    "layout does not multiply out": (
        _change("run", "dp", 2),
        "dp = 2: expected tp × cp × pp × dp = 2 × 1 × 2 × 2 = 8 to equal gpus = 16",
    ),
    "ep does not divide its group": (_change("run", "ep", 16), "ep = 16: expected ep × etp"),
    "ep does not divide the experts": (
        lambda t: (_change("run", "ep", 8)(t), _change("model", "num_experts", 12)(t)),
        "ep = 8: expected ep × etp (etp = 1) to divide a stage's tp × cp × dp = 8 ranks "
        "and ep to divide num_experts = 12",
    ),
    "vp does not divide a stage": (
        _change("run", "vp", 3),
        "vp = 3: expected a divisor of the 4 layers",
    ),
    "global batch": (
        _change("run", "global_batch", 66),
        "global_batch = 66: expected a multiple of micro_batch × dp = 1 × 4 = 4",
    ),
    "missing model": (_change("run", "model", None), 'run "small-run": missing key model'),
    "unknown model": (_change("run", "model", "gpt-5"), 'model = "gpt-5": expected a [[model]] id'),
    "unknown gpu": (_change("run", "gpu", "tpu-v5"), 'gpu = "tpu-v5": expected a [[gpu]] id'),
    "wrong type": (_change("run", "tp", "2"), 'tp = "2": expected a positive integer'),
    "no peak for the precision": (
        _change("run", "precision", "mxfp8"),
        'precision = "mxfp8": expected a precision',
    ),
    "unknown family": (_change("model", "family", "ssm"), 'family = "ssm": expected one of'),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_bad_file_is_refused_in_one_line_through_the_command(tmp_path, case):
    change, expected = REFUSALS[case]
    tables = valid_tables()
    change(tables)
    result = europa_plan(write_runs(tmp_path / "runs.toml", **tables))
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"[[run]\nid = 1", "not TOML"),
        ('[[run]]\nid = "caf\xe9"'.encode("latin-1"), "not UTF-8: byte 17 is 0xe9"),
        (b"[[gpu]]\nid = 'x'\n[[bogus]]\n", "unknown key bogus at the top"),
        (b"run = 3\n", "run: expected [[run]] tables"),
    ],
)
def test_a_malformed_file_is_refused_in_one_line(tmp_path, content, expected):
    path = tmp_path / "runs.toml"
    path.write_bytes(content)
    result = europa_plan(path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_a_run_the_file_lacks_is_refused(tmp_path):
    result = europa_plan(write_runs(tmp_path / "r.toml", **valid_tables()), "--run", "other")
    assert result.returncode == 2 and '--run "other": no such run' in result.stderr


LAYOUTS = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4]),
        "pp": st.sampled_from([1, 2, 4]),
        "cp": st.sampled_from([1, 2]),
        "dp": st.sampled_from([1, 2, 3, 4]),
        "ep": st.sampled_from([1, 2, 4, 8]),
        "gpus": st.sampled_from([8, 16, 32]),
    }
)


@given(LAYOUTS)
def test_a_layout_is_read_exactly_when_it_multiplies_out_and_divides(tmp_path_factory, layout):
    """The reader accepts a layout exactly when tp × cp × pp × dp = gpus, ep divides the
    model's 16 experts and a stage's tp × cp × dp ranks, and the batch splits over dp."""
    run = {**RUN, **layout, "vp": 1, "global_batch": 48}
    tables = valid_tables()
    tables["run"] = [run]
    fits = (
        layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"] == layout["gpus"]
        and (layout["tp"] * layout["cp"] * layout["dp"]) % layout["ep"] == 0
        and 48 % layout["dp"] == 0
    )
    path = write_runs(tmp_path_factory.mktemp("runs") / "runs.toml", **tables)
    try:
        read = load_runs(path).runs[0]
    except PlanInputError:
        assert not fits
    else:
        assert fits
        assert read.layout.gpus == read.gpus and read.micro_batches * read.layout.dp == 48


def test_a_precision_needs_its_peak_and_its_generations_efficiency(tmp_path):
    tables = valid_tables()
    tables["gpu"][0]["peak_tflops"] = {"float8": 1000.0}
    result = europa_plan(write_runs(tmp_path / "a.toml", **tables))
    assert result.returncode == 2 and "expected a table with a bfloat16 peak" in result.stderr
    tables = valid_tables()
    tables["gpu"][0]["peak_tflops"] = {"bfloat16": 500.0, "mxfp8": 1000.0}
    tables["run"][0]["precision"] = "mxfp8"  # the gpu is Hopper's: no mxfp8 efficiency
    result = europa_plan(write_runs(tmp_path / "b.toml", **tables))
    assert result.returncode == 2 and "generation hopper has a GEMM efficiency" in result.stderr
