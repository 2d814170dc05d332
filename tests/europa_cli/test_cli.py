"""The ``europa`` command, in process through ``europa.cli.app.run`` (no training here)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from europa.cli.app import run
from europa.core.config import config_to_dict
from europa.core.plugins import DISABLE_ENV, EuropaPluginManager
from europa.core.session import open_session

# What the manager says the built-ins implement (test_plugins.py pins it); the CLI must
# print exactly that.
BUILTINS = {
    info.name: list(info.hooks) for info in EuropaPluginManager(load_entry_points=False).plugins()
}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def _alone(tmp_path, monkeypatch):
    """Run as a lone process (not a torchrun/SLURM rank), in an empty folder."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- help, plugins, config show --------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_no_arguments_prints_help(capsys, argv):
    code, out, err = _run(capsys, *argv)
    assert code == 0
    assert out.startswith("Usage: europa [OPTIONS] COMMAND [ARGS]...")
    for command in ("train", "plugins", "config"):
        assert f"  {command} " in out
    assert err == ""


def test_plugins_lists_the_builtins_with_their_hooks(capsys):
    code, out, err = _run(capsys, "plugins")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    for name, hooks in BUILTINS.items():
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name}  "))
        assert lines[at].startswith(f"{name}  (europa-core ")
        assert lines[at].endswith(", built-in)")
        assert [h.strip() for h in lines[at + 1 : at + 1 + len(hooks)]] == hooks
        assert all(h.startswith("    ") for h in lines[at + 1 : at + 1 + len(hooks)])


def test_plugins_json(capsys):
    code, out, err = _run(capsys, "plugins", "--json")
    assert (code, err) == (0, "")
    infos = json.loads(out)
    assert isinstance(infos, list)
    for info in infos:
        assert set(info) == {"name", "distribution", "version", "hooks", "builtin", "enabled"}
    by_name = {info["name"]: info for info in infos}
    for name, hooks in BUILTINS.items():
        info = by_name[name]
        assert info["hooks"] == hooks
        assert info["distribution"] == "europa-core"
        assert info["builtin"] is True and info["enabled"] is True
        assert isinstance(info["version"], str) and info["version"]
    assert [i["name"] for i in infos][: len(BUILTINS)] == list(BUILTINS)
    assert all(not i["builtin"] and not i["enabled"] for i in infos[len(BUILTINS) :])


def test_config_show_prints_the_resolved_config(capsys):
    code, out, err = _run(capsys, "config", "show")
    assert (code, err) == (0, "")
    expected, _ = open_session(None, manager=EuropaPluginManager())
    assert tomllib.loads(out) == config_to_dict(expected)
    assert tomllib.loads(out)["preset"] == "tiny"
    assert tomllib.loads(out)["activation_checkpointing"] == {"mode": "none"}


def test_config_show_preset_with_overrides(capsys):
    code, out, err = _run(
        capsys,
        "config",
        "show",
        "debug",
        "--set",
        "training.steps=7",
        "--set",
        "optimizer.name=muon",
    )
    assert (code, err) == (0, "")
    shown = tomllib.loads(out)
    assert shown["preset"] == "debug"
    assert shown["training"]["steps"] == 7
    assert shown["optimizer"]["name"] == "muon"
    assert shown["model"]["dim"] == 256  # from the debug preset
    expected, _ = open_session("debug", ["training.steps=7", "optimizer.name=muon"])
    assert shown == config_to_dict(expected)


def test_config_show_output_loads_again(capsys, tmp_path):
    code, out, _ = _run(capsys, "config", "show", "debug", "--set", "training.steps=7")
    assert code == 0
    path = tmp_path / "shown.toml"
    path.write_text(out)
    code, again, err = _run(capsys, "config", "show", str(path))
    assert (code, err) == (0, "")
    assert again == out


def test_config_show_file_then_set(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "debug"\n[training]\nsteps = 11\nbatch_size = 2\n')
    code, out, err = _run(capsys, "config", "show", str(path), "--set", "training.steps=3")
    assert (code, err) == (0, "")
    shown = tomllib.loads(out)
    assert (shown["preset"], shown["training"]["steps"], shown["training"]["batch_size"]) == (
        "debug",
        3,
        2,
    )


# -- bad input: exit 2, one line on stderr, never a traceback ---------------------------------

FT = ("fault_tolerance.enabled=true", "parallel.dp_replicate=2")
BAD = [
    (["train", "--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'."),
    (["config"], None),
    (["plugins", "extra"], None),
    (
        ["config", "show", "--set", "model.top_kk=3"],
        "model.top_kk = 3: unknown key; did you mean model.top_k?",
    ),
    (
        ["config", "show", "--set", "training.steps=1.5"],
        "training.steps = 1.5: expected an integer > 0",
    ),
    (
        ["config", "show", "--set", "foo"],
        '--set "foo": expected KEY=VALUE, e.g. training.steps=100',
    ),
    (["config", "show", "huge"], 'config = "huge": expected a TOML file or a preset name'),
    (
        ["config", "show", "--set", "preset=huge"],
        'preset = "huge": expected one of "debug", "kimi-k2", "small", "tiny"',
    ),
    (
        ["config", "show", "missing.toml"],
        'config = "missing.toml": expected a TOML file or a preset name',
    ),
    (["config", "show", "-p", "nope"], None),
    (["config", "show", "--set"], "Option '--set' requires an argument."),
    (["train", "--set", "training.steps=0"], "training.steps = 0: expected an integer > 0"),
    (["train", "--set", "run.name=2024-01-01"], "run.name = 2024-01-01: expected a string"),
    (
        ["train", "--set", "optimizer.name=muon", "--set", "optimizer.qk_clip_tau=0"],
        "optimizer.qk_clip_tau = 0: expected a finite number > 0",
    ),
    (
        ["train", "--set", "optimizer.qk_clip_tau=-5"],
        "optimizer.qk_clip_tau = -5: expected a finite number > 0",
    ),
    (
        ["train", "--set", 'optimizer.qk_clip_tau="high"'],
        'optimizer.qk_clip_tau = "high": expected a finite number > 0',
    ),
    (
        ["train", "--set", "optimizer.qk_clip=true"],
        'optimizer.qk_clip = true: expected false with optimizer.name = "adamw" (QK-clip is '
        'MuonClip\'s: it needs optimizer.name = "muon")',
    ),
    *[
        (["train", *(f"--set={s}" for s in FT), *argv], message)
        for argv, message in [
            (
                ["--set", "fault_tolerance.min_replicas=3"],
                "fault_tolerance.min_replicas = 3: expected at most parallel.dp_replicate (2)",
            ),
            (
                ["--set", 'fault_tolerance.lighthouse="not a url"'],
                'fault_tolerance.lighthouse = "not a url": expected http://host:port, or '
                "empty for one on 127.0.0.1",
            ),
            (
                ["--set", 'fault_tolerance.lighthouse="http://127.0.0.1:port"'],
                'fault_tolerance.lighthouse = "http://127.0.0.1:port": expected '
                "http://host:port, or empty for one on 127.0.0.1",
            ),
            (
                ["--nproc", "3"],
                "--nproc = 3: expected a multiple of parallel.dp_replicate (2), the replica "
                "groups sharing this machine's ranks",
            ),
            (
                ["--replica-group", "2", "--run-dir", "runs/group"],
                "--replica-group = 2: expected 0 to 1 (parallel.dp_replicate = 2)",
            ),
            (
                ["--set", "fault_tolerance.join_timeout_s=30"],
                "fault_tolerance.join_timeout_s = 30.0: expected more than "
                "fault_tolerance.step_timeout_s (60.0)",
            ),
            (
                ["--set", "parallel.dp_replicate=1"],
                "parallel.dp_replicate = 1: expected 2 or more replica groups with "
                "fault_tolerance.enabled",
            ),
        ]
    ],
    (
        ["train", "--nproc", "2", "--set", "parallel.cp=4"],
        "parallel.cp = 4: expected a divisor of the 2 data-parallel ranks, which it cuts into "
        "groups sharing each sequence",
    ),
    (
        ["train", "--nproc", "2", "--set", "parallel.cp=2", "--set", "training.seq_len=126"],
        "training.seq_len = 126: expected a multiple of 2 × parallel.cp = 4 (each rank holds "
        "two of 4 equal chunks of a sequence)",
    ),
    (
        ["train", "--set", 'parallel.cp_exchange="keys"'],
        'parallel.cp_exchange = "keys": expected one of "latent", "kv"',
    ),
    (
        ["lighthouse", "--heartbeat-timeout-s", "100"],
        "--join-timeout-s = 90.0: expected more than --heartbeat-timeout-s (100.0)",
    ),
    (["train", "--resume"], None),
    (["train", "--nproc", "0"], None),
    (["train", "--nproc", "two"], None),
    (["train", "-p", "nope"], None),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert "Traceback" not in out + err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("europa: error: ")
    if message is not None:
        assert err == f"europa: error: {message}\n"
    assert not Path("runs").exists()


def test_resume_needs_run_dir(capsys):
    code, _, err = _run(capsys, "train", "--resume")
    assert code == 2
    assert "--resume needs --run-dir" in err


def test_nproc_zero_names_the_option(capsys):
    code, _, err = _run(capsys, "train", "--nproc", "0")
    assert code == 2
    assert "--nproc" in err


def test_unknown_plugin_lists_what_is_installed(capsys):
    code, _, err = _run(capsys, "train", "-p", "nope")
    assert code == 2
    assert err.startswith(
        "europa: error: plugins.enabled = ['nope']: 'nope' is not an installed plugin; "
        "expected one of: "
    )


def test_resume_of_an_empty_run_dir(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, out, err = _run(capsys, "train", "--resume", "--run-dir", str(tmp_path / "empty"))
    assert code == 2
    assert "Traceback" not in out + err
    assert err.count("\n") == 1 and err.startswith("europa: error: ")
    assert str(tmp_path / "empty") in err


def test_train_kimi_k2_is_refused_for_memory_before_allocating(capsys):
    start = time.monotonic()
    code, out, err = _run(capsys, "train", "kimi-k2")
    elapsed = time.monotonic() - start
    assert code == 2
    assert "Traceback" not in out + err
    assert err.count("\n") == 1
    assert err.startswith(
        "europa: error: kimi-k2: 1 rank(s) on this cpu machine: the most loaded rank needs "
    )
    # the terms of the moment at its peak (the optimizer step's, parameters first)
    assert "(parameters 3.7 TiB, " in err
    assert ", optimizer_state 3.7 TiB, " in err and ", gradients 3.7 TiB, " in err
    assert "expected more ranks" in err
    assert elapsed < 30, f"refusing kimi-k2 took {elapsed:.1f} s"
    assert not Path("runs").exists()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("raise ImportError('no torch here')\n", ["failed to load", "ImportError: no torch here"]),
        (
            "@hookimpl\ndef europa_after_stepp(job, step, metrics):\n    pass\n",
            ["does not match the europa hook specs", "europa_after_stepp"],
        ),
    ],
    ids=["import-error", "misspelled-hook"],
)
def test_broken_installed_plugin_is_one_line(capsys, tmp_path, monkeypatch, body, words):
    module = f"europa_cli_broken_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        'import pluggy\n\nhookimpl = pluggy.HookimplMarker("europa")\n' + body
    )
    info = tmp_path / "europa_broken-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: europa-broken\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[europa]\nbroken = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        code, out, err = _run(capsys, "plugins")
        assert code == 2
        assert "Traceback" not in out + err
        assert err.count("\n") == 1
        assert err.startswith("europa: error: plugin 'broken' from europa-broken ")
        assert all(word in err for word in words), err
        assert err.endswith(f"(set {DISABLE_ENV}=broken to skip it)\n")
        monkeypatch.setenv(DISABLE_ENV, "broken")
        code, out, err = _run(capsys, "plugins")
        assert (code, err) == (0, "")
        assert "broken" not in out
    finally:
        sys.modules.pop(module, None)


# -- the installed console script ----------------------------------------------------------


def test_console_script_bad_key_exits_2_with_one_line(tmp_path):
    europa = shutil.which("europa") or str(Path(sys.executable).parent / "europa")
    assert Path(europa).exists(), europa
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(
        [europa, "config", "show", "--set", "model.top_kk=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert (
        proc.stderr == "europa: error: model.top_kk = 3: unknown key; did you mean model.top_k?\n"
    )


def test_commands_that_need_no_model_start_without_loading_torch():
    """``europa --help``, ``plugins`` and ``config`` answer in a fraction of a second: the
    plugin manager and every installed plugin load without torch (or torchtitan, which
    alone took some 5 s of start-up before)."""
    probe = (
        "import sys\n"
        "from europa.cli.app import run\n"
        "for args in (['--help'], ['plugins'], ['config', 'show', 'tiny']):\n"
        "    assert run(args) == 0, args\n"
        "print(sorted(m for m in ('torch', 'torchtitan') if m in sys.modules))\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip().splitlines()[-1] == "[]"
