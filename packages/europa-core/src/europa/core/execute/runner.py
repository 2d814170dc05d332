"""Execute chosen ranks of a plan, each in a process of its own, and collect what they measured.

Each rank runs ``europa.core.execute.program`` in a fresh interpreter (the fake process
group, the stand-in accelerator and the patched ``torch.distributed`` are process-wide)
with one OpenMP thread, so as many ranks run side by side as the machine has cores. The
resolved config and each rank's spec go through a temporary folder, removed afterwards:
an execution writes nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from europa.core.config.loader import config_to_toml
from europa.core.errors import ConfigError, LaunchError
from europa.core.execute.program import RankSpec
from europa.spec.execution import RoutingModel


def parse_ranks(text: str, world_size: int) -> list[int]:
    """``--execute``: global ranks, comma separated; ``last`` is the last one. One line
    naming the value when a rank is not one of the world's."""
    ranks: list[int] = []
    for part in text.split(","):
        word = part.strip()
        if word == "last":
            rank = world_size - 1
        else:
            try:
                rank = int(word)
            except ValueError:
                rank = -1
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"--execute = {text!r}: {word!r} is not a rank of the {world_size}; expected "
                f"ranks from 0 to {world_size - 1} (or 'last'), comma separated"
            )
        if rank not in ranks:
            ranks.append(rank)
    return ranks


def check_executable(config) -> None:
    """Refuse, in one line, a config whose step cannot run on fake tensors: torch's grouped
    GEMM, which the routed experts run, has fake kernels for bfloat16 inputs only."""
    if config.parallel.pp > 1 and config.parallel.pp_overlap_f_b != "off":
        raise ConfigError(
            f"parallel.pp_overlap_f_b = {config.parallel.pp_overlap_f_b!r} with --execute: "
            'expected "off"; paired chunks side by side run a second thread, which the fake '
            "mode (a thread's own) does not see"
        )
    if config.model.num_experts and config.training.dtype != "bfloat16":
        raise ConfigError(
            f"training.dtype = {config.training.dtype!r}: --execute runs the routed experts' "
            "grouped GEMM on fake tensors, which torch has for 'bfloat16' only; expected "
            'training.dtype = "bfloat16" with --execute'
        )


def backend_of(config, device: str) -> str:
    """The backend the planned run would use (``parallel.backend``, "auto": by device)."""
    if config.parallel.backend != "auto":
        return config.parallel.backend
    return "nccl" if device == "cuda" else "gloo"


def execute_plan(
    plan,
    ranks: Sequence[int],
    routing: RoutingModel,
    on_rank: Callable[[int], None] = lambda rank: None,
) -> list[dict[str, Any]]:
    """Each of ``ranks`` of ``plan`` executed; ``on_rank(rank)`` is told before each."""
    check_executable(plan.config)
    hardware = plan.hardware
    per_node = plan.config.parallel.ranks_per_node or hardware.gpus_per_node
    with tempfile.TemporaryDirectory(prefix="europa-execute-") as folder:
        config_path = Path(folder) / "config.toml"
        config_path.write_text(config_to_toml(plan.config))

        def execute(rank: int) -> dict[str, Any]:
            on_rank(rank)
            spec = RankSpec(
                config_path=str(config_path),
                rank=rank,
                world_size=plan.world_size,
                ranks_per_node=min(per_node, plan.world_size),
                device=hardware.device,
                backend=backend_of(plan.config, hardware.device),
                routing=routing.describe(),
                host_bytes_per_rank=_host_bytes(plan),
            )
            return _run_rank(spec, Path(folder))

        side_by_side = max(1, min(len(ranks), os.cpu_count() or 1))
        pool = ThreadPoolExecutor(side_by_side)  # each thread waits on its rank's process
        try:
            return [done.result() for done in [pool.submit(execute, r) for r in ranks]]
        finally:  # after a failure, no rank not yet started starts
            pool.shutdown(cancel_futures=True)


def _host_bytes(plan) -> int:
    """The host memory a rank of the planned machine has: a CPU rank's is its memory."""
    return plan.device_capacity if plan.hardware.device == "cpu" else plan.host_capacity


def _run_rank(spec: RankSpec, folder: Path) -> dict[str, Any]:
    spec_path = folder / f"rank-{spec.rank}.json"
    out_path = folder / f"rank-{spec.rank}-result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-m", "europa.core.execute.program", str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not out_path.is_file():
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise LaunchError(f"--execute: rank {spec.rank} failed: {last.removeprefix('[rank')}")
    return json.loads(out_path.read_text())
