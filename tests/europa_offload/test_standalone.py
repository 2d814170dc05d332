"""europa-offload used alone: the README's loop, in an environment without europa-core."""

from __future__ import annotations

import ast
import re

from tests.installs import PACKAGES, python_with_only, run_each_without_core


def _readme_example(section: str = "In your own training loop") -> str:
    text = (PACKAGES / "europa-offload" / "README.md").read_text()
    return re.search(rf"## {section}\n.*?```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_loop_runs_with_torch_and_this_package_alone(tmp_path):
    python = python_with_only(tmp_path, "europa-offload")
    out, titan = run_each_without_core(
        python,
        [
            _readme_example() + "\nimport europa.offload.plugin\nprint('losses', losses)",
            # The torchtitan section's block: torchtitan's job config, its ModelSpec wrapped.
            _readme_example("In torchtitan")
            + "\nprint(config.model_spec.parallelize_fn.__qualname__)",
        ],
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 5
    allocations = {line.rsplit(" ", 1)[1] for line in steps}
    assert len(allocations) == 1  # the pool stopped growing after the first step
    assert all("offloaded 0.0 MiB" not in line for line in steps)
    losses = ast.literal_eval(lines[-1].removeprefix("losses "))
    assert losses[-1] < losses[0]
    assert titan.returncode == 0, titan.stderr
    assert titan.stdout.strip().endswith("with_offload.<locals>.parallelize_then_offload")
