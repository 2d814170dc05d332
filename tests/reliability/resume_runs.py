"""Resume other runs' checkpoints on this group's world size (any number of ranks).

For each run: the source run's directory is copied with only its first checkpoint,
a Trainer resumes it, and rank 0 returns the whole (unsharded) weights it restored
and the metrics of the steps it then trains."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Resume:
    name: str
    source: str  # the run whose first checkpoint is resumed
    overrides: list[str] = field(default_factory=list)  # the source's config, then these


def _whole_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer in full (a collective)."""
    layout = getattr(trainer.state, "layout", None)  # FlexShard's checkpoint state
    if layout is not None:
        weights = layout.full_parameters()
    else:
        weights = {
            name: param.full_tensor() if hasattr(param, "full_tensor") else param
            for name, param in trainer.model.named_parameters()
        }
    persistent = trainer.model.state_dict().keys()
    weights.update(
        (name, buffer)
        for name, buffer in trainer.model.named_buffers()
        if name in persistent and name not in weights
    )
    return {name: tensor.detach().cpu().clone() for name, tensor in weights.items()}


def resume_runs(rank: int, world: int, root: str, runs: list[Resume]) -> dict[str, dict]:
    import torch.distributed as dist

    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    results = {}
    for run in runs:
        run_dir = Path(root) / run.name
        source = Path(root) / run.source
        overrides = [*run.overrides, "metrics.progress=false"]
        config, plugins = open_session(source / "config.toml", overrides)
        if rank == 0:
            shutil.copytree(source, run_dir)
            for later in sorted((run_dir / "checkpoints").glob("step-*"))[1:]:
                shutil.rmtree(later)
            prepare_run_dir(config, run_dir, resume=True)
        dist.barrier()
        device, mesh = init_distributed(
            config.parallel, ProcessPlace(rank, world, rank, "torchrun")
        )
        job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world,
                  local_rank=rank, device=device, mesh=mesh)  # fmt: skip
        first = sorted((run_dir / "checkpoints").glob("step-*"))[0]
        trainer = Trainer(job, plugins, first)
        trainer.restore()
        weights = _whole_weights(trainer)
        trainer.run()
        dist.barrier()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        records = [json.loads(line) for line in lines]
        results[run.name] = {"weights": weights if rank == 0 else None, "records": records}
    return results
