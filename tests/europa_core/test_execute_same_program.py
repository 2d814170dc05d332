"""The same program, run and executed: a real gloo run of the debug model (FlexShard with
``ep``, offload, overlap, recomputation) on 2 and 4 ranks counts, per kind of traffic and
link, exactly the bytes its execution on fake tensors counts on gloo's path, and the plan
states those bytes."""

from __future__ import annotations

import pytest

from europa.core.execute.compare import NEGLIGIBLE_BYTES
from europa.core.execute.runner import execute_plan
from europa.core.plan import load_profile, make_plan
from europa.core.session import open_session
from europa.spec.execution import RoutingModel

PLUGINS = ["flexshard", "offload", "overlap"]


def _settings(ranks: int) -> list[str]:
    return [
        f"parallel.ep={ranks}",
        "parallel.dp_shard=-1",
        f"parallel.ranks_per_node={ranks}",  # one node: the flat exchange
        'training.dtype="bfloat16"',  # torch's grouped GEMM has fake kernels for bf16 only
        "model.n_layers=2",  # one dense block, one MoE block
        "training.batch_size=2",
        "training.seq_len=32",  # 64 tokens x top-3 over 8 experts: 24 pairs for each
        'activation_checkpointing.mode="full"',
        "offload.min_tensor_kib=1",
    ]


def real_rank_traffic(rank: int, world: int) -> dict:
    """One rank of a real gloo run: the trainer's phases and two steps, the second counted,
    with torchtitan's round-robin routing (every expert the same share, as uniform routing
    expects)."""
    from pathlib import Path

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from europa.core.execute.program import run_step_program
    from europa.core.execute.traffic import TrafficCount
    from europa.core.job import Job
    from europa.core.launch.distributed import MESH_AXES, mesh_shape
    from europa.core.model.materialise import MatrixInitialiser

    config, manager = open_session("debug", _settings(world), PLUGINS)
    mesh = init_device_mesh("cpu", mesh_shape(config.parallel, world), mesh_dim_names=MESH_AXES)
    job = Job(
        config=config,
        run_dir=Path("."),
        rank=rank,
        world_size=world,
        ranks_per_node=world,
        device=torch.device("cpu"),
        mesh=mesh,
    )
    measured = run_step_program(
        job,
        manager,
        TrafficCount(rank=rank, per_node=world),
        initialiser=lambda model: MatrixInitialiser(model, config.run.seed),
        balanced_routing=True,
    )
    return measured["traffic"]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_a_real_run_and_its_execution_send_the_same_bytes_the_plan_states(world, ranks):
    real = ranks(real_rank_traffic, world)
    config, manager = open_session("debug", _settings(world), PLUGINS)
    plan = make_plan(config, manager, load_profile("cpu"), world)
    compared = [0, world - 1]  # each execution is an interpreter of its own: two will do
    executed = execute_plan(plan, compared, RoutingModel())
    for rank, execution in zip(compared, executed, strict=True):
        fake = execution["traffic"]
        assert fake == real[rank], rank
        assert set(fake) >= {"parameter_gather", "gradient_reduce_scatter", "expert_all_to_all"}
        planned = {(t.kind, t.link): t.bytes_per_step for t in plan.traffic_of(rank)}
        for kind, links in fake.items():
            for link, nbytes in links.items():
                if (kind, link) in planned:
                    assert planned[kind, link] == nbytes, (rank, kind, link)
                else:  # what the plan leaves out: the load counts, the gradient norm's sums
                    assert nbytes < NEGLIGIBLE_BYTES, (rank, kind, link)
