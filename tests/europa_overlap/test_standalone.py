"""europa-overlap used alone: the README's loop, in an environment without europa-core."""

from __future__ import annotations

import ast
import re

from tests.installs import PACKAGES, python_with_only, run_each_without_core


def _readme_example(section: str = "In your own training loop") -> str:
    text = (PACKAGES / "europa-overlap" / "README.md").read_text()
    return re.search(rf"## {section}\n.*?```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_loop_runs_with_torch_and_this_package_alone(tmp_path):
    python = python_with_only(tmp_path, "europa-overlap")
    trace = tmp_path / "trace"
    code = (
        f"import os\nos.environ['TRACE_DIR'] = {str(trace)!r}\n"
        + _readme_example()
        + "\nimport europa.overlap.plugin\nprint('losses', losses)"
    )
    out, titan, light = run_each_without_core(
        python,
        [
            code,
            # The torchtitan section's block: torchtitan's job config, its ModelSpec wrapped.
            _readme_example("In torchtitan")
            + "\nprint(config.model_spec.parallelize_fn.__qualname__)",
            # Every europa command imports the plugin module: it must not pull in torch.
            "import sys, europa.overlap.plugin\nassert 'torch' not in sys.modules",
        ],
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len([line for line in lines if line.startswith("step ")]) == 4
    assert (trace / "trace.html").exists() and (trace / "trace.json").exists()
    assert len((trace / "overlap" / "timeline-rank0.jsonl").read_text().splitlines()) == 4
    losses = ast.literal_eval(lines[-1].removeprefix("losses "))
    assert losses[-1] < losses[0]
    assert titan.returncode == 0, titan.stderr
    assert titan.stdout.strip().endswith("with_overlap.<locals>.parallelize_then_overlap")
    assert light.returncode == 0, light.stderr
