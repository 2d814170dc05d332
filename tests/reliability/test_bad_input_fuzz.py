"""Arbitrary input to the config loader, ``--set`` and ``-p``: it loads, or it fails with the
project's user-error class in one line, which the CLI turns into exit 2. Never another
exception (UnicodeDecodeError, RecursionError, KeyError, ...)."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from europa.cli.app import run
from europa.core.errors import EuropaError
from europa.core.plugins import DISABLE_ENV, EuropaPluginManager
from europa.core.session import open_session

FAST = settings(max_examples=300, deadline=None, derandomize=True)
CLI = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# Pieces of TOML that reach past the parser into the typed checks, glued at random.
TOML_PIECES = st.sampled_from(
    [
        "\n", " ", "=", ".", "[", "]", "[[", "]]", "{", "}", ",", '"', "'", "#", "\\",
        "preset", '"tiny"', "training", "steps", "model", "dim", "plugins", "enabled",
        "overlap", "offload", "flexshard", "run", "name", "1", "-1", "0.5", "1e400", "nan",
        "true", "[]", '["offload"]', "1979-05-27", "\x00", "\udcff", "é", "\u2028", "\r",
    ]
)  # fmt: skip
FILE_CONTENTS = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.lists(TOML_PIECES, max_size=30).map(
        lambda pieces: "".join(pieces).encode("utf-8", "surrogatepass")
    ),
    st.integers(1, 2000).map(lambda depth: b"x = " + b"[" * depth + b"]" * depth),
)
OVERRIDES = st.one_of(
    st.text(max_size=60),
    st.tuples(
        st.sampled_from(["training.steps", "model.dim", "run.name", "plugins.enabled", "x", ""]),
        st.lists(TOML_PIECES, max_size=12).map("".join),
    ).map("=".join),
    st.integers(1, 2000).map(lambda depth: "x=" + "[" * depth + "]" * depth),
)
PLUGIN_NAMES = st.one_of(st.text(max_size=30), st.sampled_from(["offload", "overlap", "flexshard"]))


@pytest.fixture(scope="module")
def manager() -> EuropaPluginManager:
    return EuropaPluginManager(environ={})


def _loads_or_fails_in_one_line(manager, source=None, overrides=(), plugins=()) -> None:
    try:
        open_session(source, overrides, plugins, manager)
    except EuropaError as err:
        assert len(str(err).splitlines()) == 1, str(err)
    finally:
        manager.enable([])


@FAST
@given(contents=FILE_CONTENTS)
def test_any_file_contents_load_or_fail_in_one_line(manager, contents):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_bytes(contents)
        _loads_or_fails_in_one_line(manager, source=path)


@FAST
@given(overrides=st.lists(OVERRIDES, max_size=3), plugins=st.lists(PLUGIN_NAMES, max_size=3))
def test_any_set_and_plugin_strings_load_or_fail_in_one_line(manager, overrides, plugins):
    _loads_or_fails_in_one_line(manager, overrides=overrides, plugins=plugins)


@pytest.fixture
def _no_disabled_plugins(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)


def _cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(argv)
    return code, err.getvalue()


@CLI
@given(
    contents=FILE_CONTENTS,
    overrides=st.lists(OVERRIDES, max_size=2),
    plugins=st.lists(PLUGIN_NAMES, max_size=2),
)
def test_the_cli_exits_0_or_2_with_one_line(_no_disabled_plugins, contents, overrides, plugins):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_bytes(contents)
        argv = ["config", "show", str(path)]
        argv += [f"--set={text}" for text in overrides] + [f"--plugin={name}" for name in plugins]
        code, err = _cli(argv)
    if code == 0:
        assert err == ""
    else:
        assert code == 2, err
        assert err.startswith("europa: error: ") and err.endswith("\n"), err
        assert len(err.splitlines()) == 1, err
        assert "Traceback" not in err
