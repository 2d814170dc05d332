"""Several ``europa train`` runs inside one spawned group of gloo ranks.

Each run is what one rank of ``europa train`` does (the same Trainer), so one
process start serves many configurations; rank 0 returns each run's metrics."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from europa.core.run_dir import CACHE


@dataclass(frozen=True)
class Run:
    name: str
    overrides: list[str] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    resume_from: str | None = None  # another run's name: its step-2 checkpoint
    preset: str = "tiny"


# This process's runs by their [data] table: the run whose cache holds that data prepared.
_PREPARED: dict[str, Path] = {}


def _seed_cache(config, run_dir: Path) -> None:
    """Rank 0, before its Trainer opens the data: the corpus an earlier run of this group
    with the same ``[data]`` prepared (the cache's ``text-*`` folders are keyed by the text,
    tokenizer and field), copied into this run's cache instead of tokenised again."""
    earlier = _PREPARED.get(repr(config.data))
    if earlier is None or earlier == run_dir:
        return
    for folder in (earlier / CACHE).glob("text-*"):
        if not (run_dir / CACHE / folder.name).exists():
            shutil.copytree(folder, run_dir / CACHE / folder.name)


def rank_trainer(rank: int, world: int, config, plugins, run_dir: Path, resume_from=None):
    """The Trainer ``europa train`` builds on this rank of a spawned gloo group."""
    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.train.loop import Trainer

    place = ProcessPlace(rank, world, rank, "torchrun")
    device, mesh = init_distributed(config.parallel, place)
    job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world,
              local_rank=rank, device=device, mesh=mesh)  # fmt: skip
    if rank == 0:
        _seed_cache(config, run_dir)
    trainer = Trainer(job, plugins, resume_from)
    if rank == 0:
        _PREPARED.setdefault(repr(config.data), run_dir)
    return trainer


def train_runs(rank: int, world: int, root: str, runs: list[Run]) -> dict[str, list[dict]]:
    import torch.distributed as dist

    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session

    records = {}
    for run in runs:
        run_dir = Path(root) / run.name
        overrides = [*run.overrides, "metrics.progress=false"]
        config, plugins = open_session(run.preset, overrides, run.plugins)
        if rank == 0:
            if run.resume_from:
                shutil.copytree(Path(root) / run.resume_from, run_dir)
                for later in sorted((run_dir / "checkpoints").glob("step-*"))[1:]:
                    shutil.rmtree(later)
            prepare_run_dir(config, run_dir, resume=run.resume_from is not None)
        dist.barrier()
        saved = sorted((run_dir / "checkpoints").glob("step-*"))  # the one kept above
        first = saved[0] if run.resume_from else None
        trainer = rank_trainer(rank, world, config, plugins, run_dir, first)
        trainer.run()
        assert plugins.teardown(trainer.job, None) is None  # as europa train ends a run
        dist.barrier()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        records[run.name] = [json.loads(line) for line in lines]
    return records
