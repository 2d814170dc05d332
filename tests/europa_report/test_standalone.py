"""europa-report used alone: a run directory drawn as a page in an environment with europa-spec
and its own dependencies, without europa-core."""

from __future__ import annotations

import json

from tests.installs import python_with_only, run_without_core


def test_a_run_directory_is_drawn_without_europa_core(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[training]\nsteps = 2\n[plugins]\nenabled = []\n")
    records = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "tokens_seen": 64 * s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    python = python_with_only(tmp_path, "europa-report")
    page = tmp_path / "page.html"
    out = run_without_core(
        python,
        "from pathlib import Path\n"
        "from europa.report.page import write_report\n"
        f"write_report([Path({str(run)!r})], Path({str(page)!r}))\n"
        "import europa.report.plugin\n",
    )
    assert out.returncode == 0, out.stderr
    assert "loss" in page.read_text()
