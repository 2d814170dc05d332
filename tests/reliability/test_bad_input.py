"""Inputs a user will type, through the ``europa`` command: each ends in exit 2, one line on
stderr naming the key, the value and what was expected, no traceback, and the run directory
exactly as it was (a run directory that did not exist still does not).

The table runs in process through ``europa.cli.app.run`` (what the console script calls), with
training itself replaced by a failure, so a case the product accepts cannot start a run. Two
cases go through the installed console script to prove the exit status end to end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest

from europa.cli.app import run
from europa.core.plugins import DISABLE_ENV
from europa.core.run_dir import CONFIG_FILE

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
PREFIX = "europa: error: "


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # RUN stands for the run directory, files for those made by _inputs
    key: str
    value: str
    expected: str  # words after "expected"


CASES = [
    Case("mesh-not-a-divisor", ("--nproc", "3", "--set", "parallel.dp_replicate=2"),
         "parallel.dp_replicate", "2", "a divisor of the 3 ranks"),
    Case("mesh-too-large", ("--nproc", "2", "--set", "parallel.dp_shard=4"),
         "parallel.dp_shard", "4", "the 2 ranks"),
    Case("ep-without-a-layout", ("--nproc", "2", "--set", "parallel.ep=2"),
         "parallel.ep", "2", "1, or enable a plugin"),
    Case("ranks-per-node-not-a-divisor",
         ("-p", "flexshard", "--nproc", "4", "--set", "parallel.ep=4",
          "--set", "parallel.ranks_per_node=3"),
         "parallel.ranks_per_node", "3", "a divisor of the 4 ranks"),
    Case("ep-group-straddling-nodes",
         ("-p", "flexshard", "--nproc", "6", "--set", "parallel.ep=3",
          "--set", "parallel.ranks_per_node=2"),
         "parallel.ep", "3", "a divisor or a multiple of the 2 ranks per node"),
    Case("max-nodes-beyond-the-ep-group",
         ("-p", "flexshard", "--nproc", "4", "--set", "parallel.ep=4",
          "--set", "parallel.ranks_per_node=2", "--set", "parallel.ep_max_nodes_per_token=3"),
         "parallel.ep_max_nodes_per_token", "3", "at most the 2 node(s)"),
    Case("max-nodes-with-uneven-experts",
         ("-p", "flexshard", "--nproc", "4", "--set", "parallel.ep=4",
          "--set", "model.num_experts=6", "--set", "parallel.ep_max_nodes_per_token=1"),
         "parallel.ep_max_nodes_per_token", "1", "0 unless model.num_experts (6)"),
    Case("max-nodes-with-own-groups",
         ("-p", "flexshard", "--nproc", "2", "--set", "parallel.ep=2",
          "--set", "model.num_expert_groups=2", "--set", "model.num_limited_groups=1",
          "--set", "parallel.ep_max_nodes_per_token=1"),
         "model.num_expert_groups", "2", "0 when parallel.ep_max_nodes_per_token is set"),
    Case("dispatch-dtype-unknown",
         ("-p", "flexshard", "--nproc", "2", "--set", "parallel.ep=2",
          "--set", 'parallel.ep_dispatch_dtype="float8"'),
         "parallel.ep_dispatch_dtype", '"float8"', 'one of "compute", "bfloat16"'),
    Case("dispatch-without-expert-parallelism", ("--set", 'parallel.ep_dispatch="two_level"'),
         "parallel.ep_dispatch", '"two_level"', "its default when parallel.ep = 1"),
    Case("kept-exchanges-without-recomputation",
         ("-p", "flexshard", "--nproc", "2", "--set", "parallel.ep=2",
          "--set", "parallel.ep_keep_exchanges=true"),
         "parallel.ep_keep_exchanges", "true", 'activation_checkpointing.mode = "full"'),
    Case("dense-group-straddling-nodes",
         ("-p", "flexshard", "--nproc", "6", "--set", "parallel.dp_replicate=2",
          "--set", "parallel.ranks_per_node=2", "--set", 'flexshard.dense_group="node"'),
         "flexshard.dense_group", '"node"', 'flexshard.dense_group = "all"'),
    Case("plugin-not-installed", ("-p", "nosuch"),
         "plugins.enabled", "'nosuch'", "one of: "),
    Case("plugin-table-while-disabled", ("--set", "overlap.prefetch_depth=2"),
         "[overlap]", '"overlap" is not enabled', "overlap in plugins.enabled (or -p overlap)"),
    Case("plugin-table-in-file-while-disabled", ("offload.toml",),
         "[offload]", '"offload" is not enabled', "offload in plugins.enabled"),
    Case("data-folder-without-text", ("--set", "data.path=blank"),
         "data.path", "'blank'", "at least one document"),
    Case("data-folder-without-inputs", ("--set", "data.path=binary"),
         "data.path", "'binary'", "a .txt, .jsonl"),
    Case("data-path-missing", ("--set", "data.path=nowhere"),
         "data.path", "'nowhere'", "a .txt, .jsonl"),
    Case("tokenizer-larger-than-vocab",
         ("--set", "data.tokenizer=tokenizer.json", "--set", "model.vocab_size=1000"),
         "model.vocab_size", "1000", "at least the 2048 tokens of the tokenizer"),
    Case("tokenizer-missing", ("--set", "data.tokenizer=nosuch.json"),
         "data.tokenizer", "'nosuch.json'", "a tokenizer.json file"),
    Case("unknown-key", ("--set", "training.stpes=3"),
         "training.stpes", "3", ""),  # "unknown key; did you mean ..." (no "expected")
    Case("wrong-type", ("--set", 'training.steps="ten"'),
         "training.steps", '"ten"', "an integer > 0"),
    Case("out-of-bounds", ("--set", "optimizer.beta1=1.5"),
         "optimizer.beta1", "1.5", "a finite number between 0 and 1"),
    Case("not-a-finite-number", ("--set", "optimizer.lr=nan"),
         "optimizer.lr", "nan", "a finite number > 0"),
    Case("run-name-with-a-slash", ("--set", "run.name=../elsewhere"),
         "run.name", '"../elsewhere"', 'a non-empty folder name without "/"'),
    Case("run-name-not-utf8", ("--set", "run.name=caf\udce9"),  # argv bytes b"caf\xe9"
         "run.name", '"caf\\udce9"', "UTF-8 text (config.toml stores it)"),
    Case("data-path-not-utf8", ("--set", "data.path=latin1-d\udce9"),  # an existing folder
         "data.path", '"latin1-d\\udce9"', "UTF-8 text (config.toml stores it)"),
    Case("config-file-missing", ("nosuch.toml",),
         "config", '"nosuch.toml"', "a TOML file or a preset name"),
    Case("config-file-not-utf8", ("latin1.toml",),
         "config", '"latin1.toml"', "a TOML file (UTF-8 text)"),
    Case("config-file-not-toml", ("broken.toml",),
         "config", '"broken.toml"', ""),  # "invalid TOML (<tomli's reason>)"
    Case("resume-into-an-empty-directory", ("--resume", "--run-dir", "empty"),
         "--run-dir", "'empty'", "the directory of an earlier run to --resume"),
    Case("resume-without-a-checkpoint", ("--resume", "--run-dir", "no-checkpoint"),
         "--resume", "'no-checkpoint'", "checkpoints/step-* from an earlier run"),
    Case("existing-run-without-resume", ("--run-dir", "finished"),
         "--run-dir", "'finished'", "a new or empty directory, or --resume"),
    Case("run-dir-is-a-file", ("--run-dir", "tokenizer.json"),
         "--run-dir", "'tokenizer.json'", "a directory"),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _alone(tmp_path, monkeypatch):
    """A lone process (no torchrun/SLURM), in a folder holding the inputs, unable to train."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _inputs(tmp_path)

    def no_training(*args, **kwargs):
        raise AssertionError("bad input reached training")

    monkeypatch.setattr("europa.core.launch.launcher.launch_local_workers", no_training)
    monkeypatch.setattr("europa.core.train.loop.run_training", no_training)


def _inputs(root: Path) -> None:
    (root / "blank").mkdir()
    (root / "blank" / "empty.txt").write_text("\n\n")
    (root / "binary").mkdir()
    (root / "binary" / "weights.bin").write_bytes(bytes(range(256)))
    tokenizer = resources.files("europa.core.data.assets").joinpath("tokenizer.json")
    (root / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (root / "offload.toml").write_text("[offload]\nactivations = true\n")
    (root / "latin1.toml").write_bytes('[run]\nname = "café"\n'.encode("latin-1"))
    (root / "broken.toml").write_text("[training\nsteps = 3\n")
    latin1_data = root / os.fsdecode(b"latin1-d\xe9")  # "latin1-d\udce9" in Python
    latin1_data.mkdir()
    (latin1_data / "text.txt").write_text("Some text to train on.\n" * 2000)
    (root / "empty").mkdir()
    (root / "no-checkpoint").mkdir()
    (root / "no-checkpoint" / CONFIG_FILE).write_text('preset = "tiny"\n')
    (root / "finished").mkdir()
    (root / "finished" / "metrics.jsonl").write_text('{"step": 0}\n')


def _tree(path: Path) -> dict[str, tuple[int, int]] | None:
    """Every file under ``path`` with its size and mtime; folders by path; None if absent."""
    if not path.exists():
        return None
    if path.is_file():
        stat = path.stat()
        return {".": (stat.st_size, stat.st_mtime_ns)}
    tree: dict[str, tuple[int, int]] = {}
    for item in sorted(path.rglob("*")):
        stat = item.stat()
        tree[str(item.relative_to(path))] = (
            (stat.st_size, stat.st_mtime_ns) if item.is_file() else (-1, -1)
        )
    return tree


def _run_dir_of(argv: tuple[str, ...]) -> tuple[tuple[str, ...], Path]:
    if "--run-dir" in argv:
        return argv, Path(argv[argv.index("--run-dir") + 1])
    return (*argv, "--run-dir", "run"), Path("run")


def _check_one_line(code: int, out: str, err: str, case: Case) -> None:
    assert code == 2, (code, err)
    assert "Traceback" not in out + err
    assert err.endswith("\n") and len(err.splitlines()) == 1, err
    assert err.startswith(PREFIX), err
    message = err.removeprefix(PREFIX)
    assert case.key in message, message
    assert case.value in message, message
    assert f"expected {case.expected}" in message or not case.expected, message


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_train_input_is_one_line_exit_2_and_changes_nothing(capsys, case):
    argv, run_dir = _run_dir_of(case.argv)
    before = _tree(run_dir)
    code = run(["train", *argv])
    out, err = capsys.readouterr()
    _check_one_line(code, out, err, case)
    assert _tree(run_dir) == before
    assert not Path("runs").exists()


def test_unknown_key_suggests_the_nearest(capsys):
    assert run(["train", "--set", "training.stpes=3"]) == 2
    assert capsys.readouterr().err == (
        f"{PREFIX}training.stpes = 3: unknown key; did you mean training.steps?\n"
    )


def test_an_existing_empty_run_dir_keeps_no_cache_after_bad_data(capsys):
    """Preflight prepares text into the run directory's cache; bad data takes it back out."""
    Path("run").mkdir()
    assert run(["train", "--set", "data.path=blank", "--run-dir", "run"]) == 2
    assert "no text found" in capsys.readouterr().err
    assert list(Path("run").iterdir()) == []


# -- the console script, end to end ------------------------------------------------------------

SCRIPT_CASES = [
    case for case in CASES if case.id in ("config-file-not-utf8", "data-folder-without-text")
]


@pytest.mark.parametrize("case", SCRIPT_CASES, ids=[case.id for case in SCRIPT_CASES])
def test_console_script_exits_2_with_one_line(tmp_path, case):
    europa = shutil.which("europa") or str(Path(sys.executable).parent / "europa")
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARS, DISABLE_ENV)}
    argv, run_dir = _run_dir_of(case.argv)
    proc = subprocess.run(
        [europa, "train", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    _check_one_line(proc.returncode, proc.stdout, proc.stderr, case)
    assert not (tmp_path / run_dir).exists()
    assert not (tmp_path / "runs").exists()
