"""A europa plugin that injects faults, for the reliability tests (``-p faults``).

Installed for a test only: ``conftest.fault_plugin_dir`` writes it beside a
``dist-info`` whose entry point registers it, and puts that folder on the path.
Steps are 1-based, as in ``metrics.jsonl``; 0 means never.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pluggy

hookimpl = pluggy.HookimplMarker("europa")


@dataclass(kw_only=True)
class FaultsConfig:
    rank: int = field(default=1, metadata={"ge": 0, "doc": "the rank that misbehaves"})
    kill_at_step: int = field(default=0, metadata={"ge": 0, "doc": "SIGKILL as it starts"})
    raise_at_step: int = field(default=0, metadata={"ge": 0, "doc": "RuntimeError"})
    hang_at_step: int = field(default=0, metadata={"ge": 0, "doc": "SIGSTOP itself"})
    kill_in_save_of_step: int = field(default=0, metadata={"ge": 0, "doc": "FSDP2 only"})
    hold_saves: bool = field(default=False, metadata={"doc": "wait in every save for release"})
    nan_at_steps: list[int] = field(default_factory=list, metadata={"doc": "NaN logits"})


class _Faults:
    def __init__(self, config: FaultsConfig, rank: int, run_dir: Path) -> None:
        self.config = config
        self.mine = rank == config.rank
        self.run_dir = run_dir
        self.step = 0  # the step being computed, or the last one computed

    def start_step(self, step: int) -> None:
        self.step = step
        if not self.mine:
            return
        if step == self.config.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.config.hang_at_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == self.config.raise_at_step:
            raise RuntimeError(f"injected fault at step {step}")

    def poison(self, module, inputs, output):
        if self.mine and self.step in self.config.nan_at_steps:
            return output * float("nan")
        return output

    def in_save(self, *args) -> None:
        saving = self.step  # the checkpoint of the step just computed
        if self.mine and saving and saving == self.config.kill_in_save_of_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.config.hold_saves and saving:
            (self.run_dir / f"holding-save-rank-{os.environ.get('RANK', '0')}").touch()
            while not (self.run_dir / "release").exists():
                time.sleep(0.05)


def _faults(job) -> _Faults:
    return job.state["faults"]


@hookimpl
def europa_config_sections():
    return {"faults": FaultsConfig}


@hookimpl
def europa_wrap_model(job, model):
    faults = _Faults(job.config.section("faults"), job.rank, job.run_dir)
    job.state["faults"] = faults
    model.register_forward_hook(faults.poison)
    model.register_state_dict_pre_hook(faults.in_save)
    faults.model = model


@hookimpl
def europa_step_context(job, step):
    _faults(job).start_step(step + 1)


@hookimpl
def europa_after_step(job, step, metrics):
    """The sum of this rank's parameters: unchanged by a step without an update."""
    total = 0.0
    for param in _faults(job).model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += float(local.detach().double().sum())
    metrics["faults_weight_sum"] = total
