"""The Trainer that ``europa train --nproc 1`` builds, for benchmarks that time it in a
fresh process (``step_cost.py``, ``compile.py``, ``checkpoint_steps.py``).

Also imported by ``step_cost.py`` under an older git ref's packages, so it only uses
what those have (and falls back where they lack a helper)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parent)


def trial_env(threads: int, pythonpath: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a trial process: its thread count, and ``pythonpath`` (package
    sources) then this folder ahead of the inherited path."""
    path = [*pythonpath, BENCHMARKS, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(path))


def one_rank_trainer(preset: str, overrides: list[str]):
    """A one-rank gloo group and the Trainer of ``preset`` with ``overrides``, in a fresh
    run directory, with torch's deterministic mode set as ``run_training`` sets it."""
    import torch

    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    try:
        from europa.core.train.loop import use_deterministic_algorithms
    except ImportError:  # refs older than the helper set torch's mode themselves

        def use_deterministic_algorithms(on: bool) -> None:
            torch.use_deterministic_algorithms(on, warn_only=True)

    config, plugins = open_session(preset, overrides, [])
    use_deterministic_algorithms(config.training.deterministic)
    run_dir = Path(tempfile.mkdtemp()) / "run"
    prepare_run_dir(config, run_dir, resume=False)
    device, mesh = init_distributed(config.parallel, ProcessPlace(0, 1, 0, "single"))
    job = Job(config=config, run_dir=run_dir, rank=0, world_size=1, local_rank=0,
              device=device, mesh=mesh)  # fmt: skip
    return Trainer(job, plugins)
