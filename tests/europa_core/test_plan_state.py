"""The plan's per-rank parameter, gradient and optimizer-state bytes equal the
bytes real gloo ranks hold after a step of the ``debug`` preset, under FSDP2
and under FlexShard (with and without expert parallelism, and as HSDP)."""

from __future__ import annotations

import pytest

from tests.trainer_runs import Run

SMALL = ["training.batch_size=1", "training.seq_len=16", "training.steps=1"]


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _unique_storage_bytes(tensors) -> int:
    """Bytes allocated behind these tensors: views of one buffer count once
    (FSDP2 reduces each unit's gradients into one padded buffer)."""
    storages = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def held_after_one_step(rank: int, world: int, root: str, runs: list[Run]) -> list[dict]:
    import torch

    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    out = []
    for run in runs:
        config, plugins = open_session(run.preset, [*run.overrides, *SMALL], run.plugins)
        source = "single" if world == 1 else "torchrun"  # one rank runs in the test process
        place = ProcessPlace(rank, world, rank, source)
        device, mesh = init_distributed(config.parallel, place)
        job = Job(config=config, run_dir=root, rank=rank, world_size=world, local_rank=rank,
                  device=device, mesh=mesh)  # fmt: skip
        trainer = Trainer(job, plugins)
        trainer._forward_backward(0)
        trainer._clip()
        trainer.optimizer.step()
        params = list(trainer.model.parameters())
        state = [
            v for s in trainer.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)
        ]  # fmt: skip
        held = {
            "parameters": _unique_storage_bytes(params),
            "gradients": _unique_storage_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer_state": _unique_storage_bytes(state),
        }
        plan = make_plan(config, plugins, load_profile("cpu"), world)
        out.append({"run": run.name, "held": held, "planned": plan.rank_state(rank)})
    return out


# Each layout with each optimizer somewhere, kept few: a run costs seconds.
MUON = "optimizer.name='muon'"
FEW_NS = "optimizer.muon_ns_steps=1"  # state bytes do not depend on it; time does
RUNS = {
    1: [Run("fsdp2-adamw"), Run("flexshard-muon", [MUON, FEW_NS], ["flexshard"])],
    2: [Run("fsdp2-muon", [MUON, FEW_NS]), Run("flexshard-adamw", plugins=["flexshard"])],
    4: [Run("hsdp-adamw", ["parallel.dp_replicate=2"]),
        Run("flexshard-ep2-adamw", ["parallel.ep=2"], ["flexshard"])],
}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(RUNS))
def test_planned_state_equals_what_ranks_hold(ranks, tmp_path, world):
    from europa.core.launch.distributed import shutdown

    runs = [Run(r.name, r.overrides, r.plugins, preset="debug") for r in RUNS[world]]
    if world == 1:  # no process to spawn: the test process is the rank
        try:
            results = [held_after_one_step(0, 1, str(tmp_path), runs)]
        finally:
            shutdown()
    else:
        results = ranks(held_after_one_step, world, str(tmp_path), runs, timeout=300)
    for rank, per_run in enumerate(results):
        for result in per_run:
            assert result["held"] == result["planned"], (world, rank, result["run"])
