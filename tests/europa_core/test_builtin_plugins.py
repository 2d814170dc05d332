"""europa-core's default plugins: activation checkpointing, FSDP2 layout, optimizer split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from europa.core.config import load_config
from europa.core.errors import PluginError
from europa.core.job import Job
from europa.core.model import build_moe_model
from europa.core.model.materialise import materialise
from europa.core.optim import MuonWithAdamW
from europa.core.plugins.builtin import activation_checkpointing, fsdp, optimizer
from europa.core.session import open_session
from tests.conftest import run_ranks


def _job(*overrides: str) -> Job:
    config, _ = open_session("tiny", overrides)
    return Job(config=config, run_dir=Path("."))


def _model(job: Job) -> torch.nn.Module:
    model = build_moe_model(job.config.model)
    materialise(model, torch.device("cpu"), seed=0)
    return model


def _attention_calls_in_one_step(job: Job) -> int:
    model = _model(job)
    activation_checkpointing.europa_wrap_model(job=job, model=model)
    calls = []
    model.layers["1"].attention.register_forward_hook(lambda *_: calls.append(1))
    model(torch.randint(0, 2048, (1, 8))).sum().backward()
    return len(calls)


def test_full_activation_checkpointing_recomputes_each_block_in_backward():
    assert _attention_calls_in_one_step(_job()) == 1
    assert _attention_calls_in_one_step(_job('activation_checkpointing.mode="full"')) == 2


def test_fsdp_default_refuses_expert_parallelism_in_one_line():
    job = _job("parallel.ep=2")
    with pytest.raises(PluginError) as err:
        fsdp.europa_shard_model(job=job, model=build_moe_model(job.config.model))
    assert str(err.value) == (
        "parallel.ep = 2: core's FSDP2 layout has no expert parallelism; expected 1, "
        "or enable a plugin whose europa_shard_model provides it"
    )


def _layouts(rank: int, world: int, replicas: int) -> dict[str, str]:
    """Per training.dtype, what core's shard hook made of the model on ``world`` ranks
    with ``parallel.dp_replicate = replicas``: "plain", "ddp" or "fsdp2" (and then
    every parameter a DTensor)."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh(
        "cpu", (1, replicas, world // replicas), mesh_dim_names=("pp", "dp_replicate", "dp_shard")
    )
    layouts = {}
    for dtype in ("float32", "bfloat16"):
        job = _job(f'training.dtype="{dtype}"', f"parallel.dp_replicate={replicas}")
        job.mesh = mesh
        with torch.device("meta"):
            model = build_moe_model(job.config.model)
        model = fsdp.europa_shard_model(job=job, model=model)
        assert set(job.claims.values()) == {fsdp.OWNER}
        dtensors = {isinstance(p, DTensor) for p in model.parameters()}
        if isinstance(model, FSDPModule):
            assert dtensors == {True}
            layouts[dtype] = "fsdp2"
        else:
            assert dtensors == {False}
            layouts[dtype] = "ddp" if isinstance(model, DDP) else "plain"
    return layouts


@pytest.mark.parametrize(
    ("world", "replicas", "fp32_layout"),
    [(1, 1, "plain"), (2, 1, "fsdp2"), (2, 2, "ddp"), (4, 2, "fsdp2")],
)
def test_fsdp2_only_where_it_shards_or_casts(world, replicas, fp32_layout):
    # In fp32 with dp_shard = 1 FSDP2 would shard, reduce-scatter and cast nothing,
    # yet copy every gradient and gathered block through its buffers: one rank stays
    # plain, replicas use DDP. bf16 always needs FSDP2's mixed-precision policy.
    layouts = run_ranks(_layouts, world, replicas)[0]
    assert layouts == {"float32": fp32_layout, "bfloat16": "fsdp2"}


def test_adamw_is_the_default_optimizer():
    job = _job()
    built = optimizer.europa_build_optimizer(job=job, model=_model(job))
    assert isinstance(built, torch.optim.AdamW)
    assert built.param_groups[0]["lr"] == job.config.optimizer.lr


def test_muon_takes_hidden_matrices_and_leaves_the_rest_to_adamw():
    job = _job('optimizer.name="muon"')
    model = _model(job)
    built = optimizer.europa_build_optimizer(job=job, model=model)
    assert isinstance(built, MuonWithAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in built.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in built.param_groups if not g["use_muon"] for p in g["params"]}
    assert muon | adamw == set(names.values()) and not muon & adamw
    assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in muon
    assert "layers.1.attention.wkv_a.weight" in muon
    for name in (
        "tok_embeddings.weight",
        "lm_head.weight",
        "layers.1.moe.router.gate.weight",
        "layers.1.attention_norm.weight",
    ):
        assert name in adamw


def test_the_tiny_preset_is_the_default():
    assert load_config(None) == load_config("tiny")
