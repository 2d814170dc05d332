"""QK-clip inside torchtitan 0.3.0's own Trainer, on 2 gloo ranks: europa's ``debug``
model as torchtitan builds it, cut to its first two blocks, SDPA, float32, AdamW, from
one seed checkpoint on the same batches. torchtitan's FSDP2 + EP with europa-spec's
``install_qk_clip`` (the maxima agreed in a step pre-hook, the DTensor shards' rows scaled
in a post-hook) and europa-flexshard's adapter with ``qk_clip_tau`` (the maxima agreed
after clipping, the owners' rows scaled) record the same maxima, clip the same heads and
train alike; flexshard's ``optimizer.step()`` still sends nothing. Their first step's
maxima and clipped heads are those europa's own model (block-causal attention, the
trainer's ``QKClip``) finds for the same weights and batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_ranks
from tests.torchtitan_adapters.test_flexshard import LAYERS, LR, RELATIVE, TINY, _relative

STEPS = 4
TAU = 0.7  # among the debugmodel's heads' maxima (0.65 to 0.82 a layer): some clip, some not


def _recording(record: list, clip_of):
    """A watch that records each step's QK-clip metrics and what its optimizer step sent."""

    def watch(trainer) -> None:
        from tests.torchtitan_cpu import counted_traffic

        clip = clip_of(trainer)
        step = trainer.optimizers.step

        def recorded_step(*args, **kwargs):
            with counted_traffic() as traffic:
                step(*args, **kwargs)
            record.append({**clip.last_metrics, "step_bytes": traffic.bytes})

        trainer.optimizers.step = recorded_step

    return watch


def _job(rank: int, world: int, folder: Path, seed: str, run: str):
    """europa's debug model in torchtitan's Trainer (its first two blocks), ep = 2, plain
    cross-entropy, loading the seed checkpoint."""
    from torchtitan.components.checkpointer import CheckpointManager

    from tests.torchtitan_cpu import debug_job

    config = debug_job(rank, world, STEPS, str(folder), ep=2, fp32_experts=True,
                       europa_shape=True, overrides=TINY)  # fmt: skip
    config.loss = config.loss.loss_fn
    config.optimizer.param_groups[0].optimizer_kwargs["lr"] = LR
    config.model_spec.model.layers = config.model_spec.model.layers[:LAYERS]
    config.checkpoint = CheckpointManager.Config(
        enable=True, initial_load_path=seed, load_only=True, folder=f"checkpoints-{run}"
    )
    return config


def _europas_first_step(rank: int, folder: Path, seed: str) -> dict:
    """europa's model (block-causal attention) with the seed's weights, its ``QKClip``
    armed, forward on this rank's first batch: the maxima every rank agrees on."""
    import torch
    import torch.distributed.checkpoint as dcp

    from europa.core.config import load_config
    from europa.core.model import build_moe_model
    from europa.core.model.materialise import init_buffers
    from europa.core.train.batches import open_rank_batches
    from europa.spec.qk_clip_step import QKClip

    config = load_config("debug", [*TINY, f"model.n_layers={LAYERS}"])
    model = build_moe_model(config.model, attention="block_causal")
    model.to_empty(device="cpu")
    init_buffers(model, torch.device("cpu"))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=seed, no_dist=True)
    model.load_state_dict(state)
    clip = QKClip(model, LAYERS, TAU)
    batches = open_rank_batches(config, rank, 2, folder / "data", rank == 0).source
    inputs, _ = batches.batch(0, 0)
    model.train()
    model(inputs)
    return clip.metrics(clip.agreed_maxima(torch.device("cpu")), applied=True)


def _installed(trainer):
    from europa.spec.qk_clip_step import install_qk_clip

    model = trainer.model_parts[0]
    return install_qk_clip(trainer.optimizers, model, n_layers=len(model.layers), tau=TAU)


def _runs(rank: int, world: int, folder: str) -> dict:
    from tests.torchtitan_cpu import seed_checkpoint, titan, train

    titan()
    from europa.flexshard.torchtitan import flexshard_config

    folder = Path(folder)
    seed = seed_checkpoint(_job(rank, world, folder, "", "seed"), str(folder))
    fsdp: list = []
    fsdp_losses, _ = train(
        _job(rank, world, folder, seed, "fsdp"), watch=_recording(fsdp, _installed)
    )
    flex: list = []
    job = flexshard_config(
        _job(rank, world, folder, seed, "flexshard"), ranks_per_node=2, qk_clip_tau=TAU
    )
    flex_losses, _ = train(job, watch=_recording(flex, lambda t: t.optimizers.qk_clip))
    return {"fsdp": fsdp, "flexshard": flex, "fsdp_losses": fsdp_losses,
            "flexshard_losses": flex_losses,
            "europa": _europas_first_step(rank, folder, seed)}  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("qk-clip-torchtitan")), timeout=300)


@pytest.mark.distributed
def test_torchtitans_fsdp2_and_flexshard_clip_the_same_heads(ranks):
    for rank in ranks:
        fsdp, flex = rank["fsdp"], rank["flexshard"]
        assert len(fsdp) == len(flex) == STEPS
        clipped = [r["qk_heads_clipped"] for r in fsdp]
        assert any(clipped), clipped  # tau clips some heads ...
        assert all(c < 2 * 16 for c in clipped), clipped  # ... and not every one of 2 × 16
        assert [r["qk_heads_clipped"] for r in flex] == clipped
        for a, b in zip(flex, fsdp, strict=True):
            assert a["qk_logit_max"] == pytest.approx(b["qk_logit_max"], rel=RELATIVE)
        worst = max(map(_relative, rank["flexshard_losses"], rank["fsdp_losses"]))
        assert worst < RELATIVE, worst
        assert [r["step_bytes"] for r in flex] == [0] * STEPS  # the clip sends nothing there
    assert ranks[0]["fsdp"] == ranks[1]["fsdp"]  # every rank agreed on the same maxima


@pytest.mark.distributed
def test_the_first_step_clips_the_heads_europas_trainer_clips_for_the_same_weights_and_batch(
    ranks,
):
    for rank in ranks:
        europa, titan = rank["europa"], rank["fsdp"][0]
        assert titan["qk_heads_clipped"] == europa["qk_heads_clipped"] > 0
        assert titan["qk_logit_max"] == pytest.approx(europa["qk_logit_max"], rel=RELATIVE)
