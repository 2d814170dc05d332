"""Whatever a runs file holds, europa-plan answers with a plan or with one line and exit 2:
any key of any table set to a value of any type never ends in a traceback."""

from __future__ import annotations

import contextlib
import io

from hypothesis import given
from hypothesis import strategies as st

from europa.plan.cli import main
from europa.plan.keys import (
    FAMILY_OPTIONAL,
    FAMILY_REQUIRED,
    GPU_OPTIONAL,
    GPU_REQUIRED,
    MODEL_REQUIRED,
    RUN_OPTIONAL,
    RUN_REQUIRED,
)
from tests.europa_plan.runs_toml import runs_toml, valid_tables

KEYS = {
    "gpu": [*GPU_REQUIRED, *GPU_OPTIONAL],
    "model": [*MODEL_REQUIRED, *FAMILY_REQUIRED["gqa-moe"], *FAMILY_OPTIONAL["gqa-moe"]],
    "run": [*RUN_REQUIRED, *RUN_OPTIONAL],
}
VALUES = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([0, 1, 2, 3, 7, 2**40]),
    st.floats(-1, 1e6, allow_nan=False),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from(["full", "none", "bfloat16", "mxfp8", "fsdp", "hsdp", "interleaved", "zbv"]),
    st.lists(st.sampled_from(["mlp", "moe", "core_attn", 3]), max_size=3),
    st.dictionaries(st.sampled_from(["bfloat16", "float8", "step_s", "x"]), st.integers(-1, 9)),
)


@given(st.lists(st.tuples(st.sampled_from(sorted(KEYS)), st.integers(0, 99), VALUES), max_size=3))
def test_any_value_of_any_key_plans_or_is_one_line(tmp_path_factory, changes):
    tables = valid_tables()
    for kind, pick, value in changes:
        key = KEYS[kind][pick % len(KEYS[kind])]
        tables[kind][0][key] = value
    path = tmp_path_factory.mktemp("fuzz") / "runs.toml"
    path.write_text(runs_toml(**tables))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(path), "--json"])
    if code == 0:
        assert out.getvalue().startswith("{") and not err.getvalue()
    else:
        assert code == 2 and err.getvalue().count("\n") == 1, err.getvalue()
