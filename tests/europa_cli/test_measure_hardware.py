"""``europa plan --measure-hardware``: a profile measured on CPU ranks, with the keys of a
shipped one, that ``--hardware`` reads back; and a measured profile edited badly is one
line and exit 2."""

from __future__ import annotations

import re
import sys

import pytest

from europa.cli.app import run
from europa.core.plan import load_profile

MEASURE = ["plan", "tiny", "--measure-hardware", "--set", "parallel.nproc=2",
           "--set", "training.seq_len=32"]  # fmt: skip
PREFIX = "europa: error: "


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The console script's run, in this process: its ranks are spawned either way, and
    this process has already imported what a new interpreter would."""
    out = tmp_path_factory.mktemp("measured") / "mine.toml"
    argv = [*MEASURE, "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["europa", *argv])  # the command the profile records
        assert run(argv) == 0
    return out


@pytest.mark.distributed
def test_the_measured_profile_has_the_shipped_keys_and_plans(measured, capsys):
    profile = load_profile(str(measured))
    shipped = load_profile("cpu")
    assert profile.device == "cpu" and profile.gpus_per_node == 2
    for dtype, tflops in profile.peak_tflops.items():
        assert tflops > 0, dtype
    assert 0 < profile.matmul_efficiency <= 1
    assert 0 < profile.intra_node_efficiency <= 1 and profile.intra_node_gbps > 0
    collectives = profile.intra_node_collectives  # each at its own share of the link
    kinds = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "point_to_point"}
    assert set(collectives) == kinds
    assert all(0 < share <= 1 for share in collectives.values())
    assert profile.inter_node_gbps == shipped.inter_node_gbps  # one node: not measured
    # Host copies each way; on CPU one copy between host buffers, the same both ways.
    assert profile.host_to_device_gbps > 0 and profile.device_to_host_gbps > 0
    assert profile.host_to_device_gbps == profile.device_to_host_gbps
    assert profile.host_device_gbps == pytest.approx(profile.host_to_device_gbps, abs=1e-3)
    assert profile.host_to_device_efficiency == profile.device_to_host_efficiency == 1.0
    assert "inter_node: one node, kept from the base profile" in measured.read_text()
    assert set(vars(shipped)) == set(vars(profile))
    assert run(["plan", "tiny", "--hardware", str(measured), "--nodes", "1"]) == 0
    assert "measured (cpu, 1 node(s) of 2)" in capsys.readouterr().out


BAD_EDITS = [
    (r"matmul_efficiency = [0-9.]+", "matmul_efficiency = 1.5",
     "matmul_efficiency = 1.5; expected a share of the peak, in (0, 1]"),
    (r"intra_node_efficiency = [0-9.]+", "intra_node_efficiency = -0.2",
     "intra_node_efficiency = -0.2; expected a number >= 0"),
    (r"intra_node_gbps = [0-9.]+", 'intra_node_gbps = "fast"',
     "intra_node_gbps = 'fast'; expected a number >= 0"),
    (r"\nbfloat16 = [0-9.]+", "",
     "peak_tflops = {'float32': "),
    (r"gpus_per_node = 2", "gpus_per_node = 2\nintra_node_bandwidth = 3",
     "unknown key 'intra_node_bandwidth'; expected keys among"),
    (r"\nall_reduce = [0-9.]+", "\nall_reduce = 1.7",
     "intra_node_collectives.all_reduce = 1.7; expected a share of the peak, in (0, 1]"),
    (r"gpus_per_node = 2", "gpus_per_node = 2\nfilesystem_gbps = 0",
     "filesystem_gbps = 0; expected a number > 0"),
    (r"\nall_reduce = [0-9.]+", "\nbroadcast = 0.5",
     "expected a table of efficiencies by collective, among all_gather, reduce_scatter"),
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("pattern", "edit", "message"), BAD_EDITS)
def test_a_measured_profile_edited_badly_is_one_line(
    measured, tmp_path, capsys, pattern, edit, message
):
    edited = tmp_path / "edited.toml"
    text, count = re.subn(pattern, edit, measured.read_text(), count=1)
    assert count == 1
    edited.write_text(text)
    code = run(["plan", "tiny", "--hardware", str(edited)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(PREFIX) and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "tiny", "--out", "x.toml"],
            "--out = 'x.toml': expected only with --measure-hardware",
        ),
        (
            [*MEASURE, "--out", "x.txt"],
            "--out = 'x.txt': expected a .toml path in an existing folder",
        ),
        ([*MEASURE, "--out", "/no/such/dir/x.toml"], "--out = '/no/such/dir/x.toml': expected"),
        (
            [*MEASURE, "--set", "parallel.ranks_per_node=3", "--set", "parallel.nproc=4"],
            "parallel.ranks_per_node = 3: expected a divisor of the 4 ranks",
        ),
    ],
)
def test_measure_hardware_arguments_are_checked_before_anything_runs(capsys, argv, message):
    code = run(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(PREFIX + message) and err.count("\n") == 1, err
