"""Every file ``europa plan`` and ``europa train`` read (a hardware profile, a measured one,
a config given as a path) refused in one line, exit 2, no traceback, nothing written, when
it is binary, not UTF-8 or not TOML; and an integer beyond 64 bits, in ``--set``, in a
config file or in a hardware profile, refused the same way, naming the key and the value."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from europa.cli.app import run
from europa.core.config import build_config, resolve_raw
from europa.core.errors import ConfigError
from europa.core.plugins import DISABLE_ENV

PREFIX = "europa: error: "
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
HUGE = "99999999999999999999999"
INT64 = "from -9223372036854775808 to 9223372036854775807"


def _random_bytes() -> bytes:
    """What `head -c 4096 /dev/urandom` gives, the same every run."""
    return random.Random(39).randbytes(4096)


def _profile(**edits: str) -> str:
    text = resources.files("europa.core.plan.profiles").joinpath("cpu.toml").read_text()
    for key, value in edits.items():
        text = text.replace(f"\n{key} = ", f"\n{key} = {value}\n# was: ", 1)
    return text


FILES = {
    "random.toml": _random_bytes(),
    "random-no-nul.toml": bytes(b or 0xFF for b in _random_bytes()),  # not UTF-8, no NUL
    "latin1.toml": 'name = "café"\n'.encode("latin-1"),
    "nul.toml": b'name = "cpu"\n\x00\x01\x02',
    "broken.toml": b"[training\nsteps = 3\n",
    "huge-steps.toml": f"[training]\nsteps = {HUGE}\n".encode(),
    "huge-negative.toml": f"[model]\ndim = -{HUGE}\n".encode(),
    "huge-gpus.toml": _profile(gpus_per_node=HUGE).encode(),
    "huge-in-a-table.toml": _profile(
        peak_tflops=f"{{ bfloat16 = 1.0, float32 = {HUGE} }}"
    ).encode(),
}


@pytest.fixture(autouse=True)
def _alone(tmp_path, monkeypatch):
    """In a folder holding the files, unable to train or to measure."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)

    def refused(*args, **kwargs):
        raise AssertionError("bad input got past the check")

    monkeypatch.setattr("europa.core.launch.launcher.launch_local_workers", refused)
    monkeypatch.setattr("europa.core.train.loop.run_training", refused)
    monkeypatch.setattr("europa.core.plan.measure.run_measurement", refused)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _refused(capsys, tmp_path, argv: list[str], *words: str) -> str:
    before = _tree(tmp_path)
    code = run(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert "Traceback" not in out + err
    assert err.startswith(PREFIX) and err.endswith("\n") and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    assert _tree(tmp_path) == before  # nothing written
    return err


PLAN = ["plan", "tiny"]
CASES = [
    # (argv, words the one line holds)
    ([*PLAN, "--hardware", "random.toml"], ["--hardware = 'random.toml'", "expected a TOML file"]),
    ([*PLAN, "--hardware", "random-no-nul.toml"],
     ["--hardware = 'random-no-nul.toml'", "is not UTF-8", "at offset"]),
    ([*PLAN, "--hardware", "latin1.toml"],
     ["--hardware = 'latin1.toml'", "byte 0xe9 at offset 11 is not UTF-8",
      "expected a TOML file (UTF-8 text)"]),
    ([*PLAN, "--hardware", "nul.toml"],
     ["--hardware = 'nul.toml'", "byte 0x00 at offset 13, a binary file"]),
    ([*PLAN, "--hardware", "broken.toml"], ["--hardware = 'broken.toml'", "invalid TOML ("]),
    ([*PLAN, "--hardware", "huge-gpus.toml"],
     ["--hardware = 'huge-gpus.toml'", f"gpus_per_node = {HUGE}: expected an integer {INT64}"]),
    ([*PLAN, "--hardware", "huge-in-a-table.toml"],
     [f"peak_tflops.float32 = {HUGE}: expected an integer {INT64}"]),
    # a measured profile is read the same way, as --measure-hardware's base too
    ([*PLAN, "--measure-hardware", "--hardware", "random.toml", "--out", "mine.toml"],
     ["--hardware = 'random.toml'"]),
    (["plan", "random.toml"], ['config = "random.toml"', "expected a TOML file"]),
    (["plan", "random-no-nul.toml"], ['config = "random-no-nul.toml"', "is not UTF-8"]),
    (["plan", "latin1.toml"], ['config = "latin1.toml"', "byte 0xe9 at offset 11 is not UTF-8"]),
    (["plan", "nul.toml"], ['config = "nul.toml"', "byte 0x00 at offset 13, a binary file"]),
    (["plan", "broken.toml"], ['config = "broken.toml"', "invalid TOML ("]),
    (["plan", "huge-steps.toml"],
     ['config = "huge-steps.toml"', f"training.steps = {HUGE}: expected an integer {INT64}"]),
    (["plan", "huge-negative.toml"], [f"model.dim = -{HUGE}: expected an integer {INT64}"]),
    ([*PLAN, "--set", f"training.steps={HUGE}"],
     [f"training.steps = {HUGE}: expected an integer {INT64}"]),
    ([*PLAN, "--set", "training.steps=9223372036854775808"],  # 2**63, one past
     [f"training.steps = 9223372036854775808: expected an integer {INT64}"]),
    ([*PLAN, "--set", f"plugins.enabled=[1, {HUGE}]"], [f"plugins.enabled[1] = {HUGE}"]),
    (["train", "random.toml"], ['config = "random.toml"']),
    (["train", "latin1.toml"], ['config = "latin1.toml"', "is not UTF-8"]),
    (["train", "huge-steps.toml"], [f"training.steps = {HUGE}: expected an integer {INT64}"]),
    (["train", "tiny", "--set", f"training.steps={HUGE}"], [f"training.steps = {HUGE}"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_file_or_integer_is_one_line_exit_2_and_nothing_written(
    capsys, tmp_path, argv, words
):
    _refused(capsys, tmp_path, argv, *words)
    assert not Path("runs").exists()


def test_integers_within_64_bits_still_load(tmp_path):
    (tmp_path / "edge.toml").write_text("[training]\nsteps = 9223372036854775807\n")
    assert build_config(resolve_raw("edge.toml")).training.steps == 2**63 - 1


def test_a_config_built_in_python_is_held_to_64_bits_too():
    raw = resolve_raw("tiny")
    raw["training"]["steps"] = 2**63
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert str(err.value) == (
        f"training.steps = {2**63}: expected an integer > 0 within 64 bits "
        "(-9223372036854775808 to 9223372036854775807)"
    )


def test_the_console_script_refuses_random_bytes_as_hardware(tmp_path):
    """The report in issue 39, end to end: a UnicodeDecodeError traceback and exit 1 before."""
    europa = Path(sys.executable).parent / "europa"
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARS, DISABLE_ENV)}
    done = subprocess.run(
        [str(europa), "plan", "tiny", "--hardware", "random.toml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and "'random.toml'" in done.stderr
