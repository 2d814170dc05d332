"""The hook phases as ``europa.spec.hookspecs.PHASES`` states them are the order a rank of
``europa train`` calls them in; teardown runs once, after the last step or after an error,
and every plugin's teardown runs even when one fails."""

from __future__ import annotations

import pytest

from europa.spec.hookspecs import PHASES, hookimpl
from europa.spec.job import PlanningJob, RunningJob
from tests.conftest import run_ranks

RANK_PHASES = [phase for phase, _ in PHASES if phase not in ("declare", "plan")]
PHASE_OF = {hook: phase for phase, hooks in PHASES for hook in hooks}


class _Recorder:
    def __init__(self, fail_at: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at

    def _seen(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.fail_at:
            raise RuntimeError(f"{hook} failed on purpose")

    @hookimpl
    def europa_wrap_model(self, job, model):
        self._seen("europa_wrap_model")
        self.calls.append(f"running_job={isinstance(job, RunningJob)}")

    @hookimpl
    def europa_plan(self, job, plan):
        self.calls.append(f"planning_job={isinstance(job, PlanningJob)}")

    @hookimpl
    def europa_wrap_optimizer(self, job):
        self._seen("europa_wrap_optimizer")

    @hookimpl
    def europa_step_context(self, job, step):
        self._seen("europa_step_context")

    @hookimpl
    def europa_after_step(self, job, step, metrics):
        self._seen("europa_after_step")
        metrics["recorder_step"] = step  # 0-based, the record's "step" is step + 1

    @hookimpl
    def europa_teardown(self, job, error):
        self._seen("europa_teardown")
        self.calls.append(f"error={type(error).__name__ if error else None}")


class _BrokenTeardown:
    @hookimpl
    def europa_teardown(self, job, error):
        raise RuntimeError("teardown failed on purpose")


def _rank(rank: int, world: int, root: str) -> dict:
    from pathlib import Path

    from europa.core.launch.distributed import ProcessPlace
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.plugins.manager import EuropaPluginManager
    from europa.core.session import open_session
    from europa.core.train.loop import run_training

    out = {}
    for name, fail_at in (("ok", None), ("fails", "europa_after_step")):
        recorder = _Recorder(fail_at)
        manager = EuropaPluginManager(
            extra_plugins=[
                ("recorder", recorder, "tests", "0"),
                ("broken", _BrokenTeardown(), "tests", "0"),
            ]
        )
        config, plugins = open_session(
            "tiny", ["training.steps=2", "metrics.progress=false"], ["recorder", "broken"], manager
        )
        run_dir = Path(root) / name
        prepare_run_dir(config, run_dir, resume=False)
        try:
            run_training(config, run_dir, ProcessPlace(0, 1, 0, "torchrun"), plugins)
            raised = None
        except RuntimeError as err:
            raised = str(err)
        records = (run_dir / "metrics.jsonl").read_text().splitlines()
        out[name] = {"calls": recorder.calls, "raised": raised, "records": records}
    import torch.distributed as dist

    before = dist.all_reduce
    config, plugins = open_session(
        "tiny", ["training.steps=1", "metrics.progress=false", "overlap.timeline=true"], ["overlap"]
    )
    prepare_run_dir(config, Path(root) / "overlap", resume=False)
    run_training(config, Path(root) / "overlap", ProcessPlace(0, 1, 0, "torchrun"), plugins)
    out["collectives_restored"] = dist.all_reduce is before
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return run_ranks(_rank, 1, str(tmp_path_factory.mktemp("phases")))[0]


def test_a_rank_calls_the_hooks_in_the_stated_phase_order(recorded):
    calls = [c for c in recorded["ok"]["calls"] if c.startswith("europa_")]
    phases = [PHASE_OF[c] for c in calls]
    first_seen = list(dict.fromkeys(phases))
    assert first_seen == [p for p in RANK_PHASES if p in first_seen]
    assert phases == sorted(phases, key=RANK_PHASES.index)  # never back to an earlier phase
    assert calls.count("europa_after_step") == 2 and calls[-1] == "europa_teardown"
    assert "running_job=True" in recorded["ok"]["calls"]
    assert "planning_job=True" in recorded["ok"]["calls"]  # the rank's pre-flight plan
    import json

    steps = [json.loads(r) for r in recorded["ok"]["records"]]
    assert [(r["step"], r["recorder_step"]) for r in steps] == [(1, 0), (2, 1)]


def test_teardown_runs_once_after_an_error_and_every_plugin_tears_down(recorded):
    ok, fails = recorded["ok"], recorded["fails"]
    assert ok["calls"][-2:] == ["europa_teardown", "error=None"]
    # the broken plugin's teardown ran too and its failure is raised once the run is over
    assert ok["raised"] == "teardown failed on purpose"
    assert fails["calls"].count("europa_teardown") == 1
    assert fails["calls"][-1] == "error=RuntimeError"
    assert fails["raised"] == "europa_after_step failed on purpose"  # the run's own error


def test_overlap_puts_back_the_collectives_its_timeline_patched(recorded):
    assert recorded["collectives_restored"]
