"""One time model: a step's time is europa-plan's. europa-core and the technique packages
state compute FLOPs, bytes, links and what overlaps; they build no step time, no compute
seconds and play out no schedule of their own (read with ``ast``; nothing is imported).

What may stay outside europa-plan: reading a profile's rates to hand them over, and the
times that are not a step's (a checkpoint's write, a heal's copy)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2] / "packages"
# Records and functions of europa-plan's time model that only europa-plan builds or defines.
PRICING = {"StepTime", "Compute", "step_time", "pipeline_step_time"}
# The profile's flat compute rate: read only where it is handed to europa-plan
# (``flat_compute``), and where it is measured.
FLAT_RATE = "matmul_efficiency"
FLAT_RATE_READERS = {"europa/core/plan/timing.py", "europa/core/plan/measure.py"}


def _sources():
    for path in sorted(PACKAGES.glob("*/src/europa/**/*.py")):
        if path.is_relative_to(PACKAGES / "europa-plan"):
            continue
        yield path.relative_to(path.parents[len(path.relative_to(PACKAGES).parts) - 3]), path


def _calls_and_defs(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in PRICING - {"step_time", "pipeline_step_time"}:
                yield node.lineno, f"builds {name}"
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in PRICING:
            yield node.lineno, f"defines {node.name}"


def test_no_package_but_europa_plan_builds_a_step_time():
    found = [
        f"{rel}:{line}: {what}"
        for rel, path in _sources()
        for line, what in _calls_and_defs(ast.parse(path.read_text()))
    ]
    assert found == []


def test_the_profiles_flat_rate_is_only_handed_to_europa_plan_or_measured():
    readers = {
        str(rel)
        for rel, path in _sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == FLAT_RATE
    }
    assert readers <= FLAT_RATE_READERS
