"""The fit: one set of efficiencies per GPU generation, found on the published runs; it
only ever lowers the error it minimises, and reads nothing else of a run's source."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from europa.plan import fit, load_runs
from europa.plan.fit import fit_generation, generation_toml, log_errors
from europa.plan.flops import published_step

PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
RUNS = load_runs(PUBLISHED).runs


def test_the_fit_lowers_the_error_with_one_set_for_the_generation(monkeypatch):
    monkeypatch.setattr(fit, "STEP", 0.1)  # a coarse grid: the machinery, in a second
    monkeypatch.setattr(fit, "SWEEPS", 1)
    blackwell = [r for r in RUNS if r.gpu.generation == "blackwell"]
    start = blackwell[0].gpu.efficiencies
    fitted = fit_generation(blackwell, start)
    loss = lambda eff: sum(e * e for e in log_errors(blackwell, eff))  # noqa: E731
    assert loss(fitted) <= loss(start)
    assert fitted.id == start.id == "blackwell"
    for name, (low, high) in fit.BOUNDS.items():
        values = getattr(fitted, name)
        for value in values.values() if hasattr(values, "values") else [values]:
            assert low <= value <= high or value == getattr(start, name)


def test_a_fitted_table_reads_back(tmp_path):
    eff = RUNS[0].gpu.efficiencies
    text = generation_toml(dataclasses.replace(eff, id="hopper-refit"), "a test")
    path = tmp_path / "runs.toml"
    path.write_text(text + "\n")
    assert load_runs(path).generations["hopper-refit"].gemm == eff.gemm


def test_the_published_step_is_the_sources_or_what_its_tflops_imply():
    llama = next(r for r in RUNS if r.published.step_s is None)
    implied = published_step(llama)
    assert 6.0 < implied < 7.0  # 2524 GFLOP a token × 16 M tokens / 16384 GPUs at 400 TFLOP/s
