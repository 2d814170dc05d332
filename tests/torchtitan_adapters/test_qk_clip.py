"""QK-clip inside torchtitan 0.3.0's own Trainer, on 2 gloo ranks: torchtitan's
``deepseek_v3`` debugmodel cut to its first two blocks, SDPA, float32, AdamW, from one
seed checkpoint on the same batches. torchtitan's FSDP2 + EP with europa-spec's
``install_qk_clip`` (the maxima agreed in a step pre-hook, the DTensor shards' rows scaled
in a post-hook) and europa-flexshard's adapter with ``qk_clip_tau`` (the maxima agreed
after clipping, the owners' rows scaled) record the same maxima, clip the same heads and
train alike; flexshard's ``optimizer.step()`` still sends nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_ranks
from tests.torchtitan_adapters.test_flexshard import RELATIVE, _job, _relative

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


def _installed(trainer):
    from europa.spec.qk_clip_step import install_qk_clip

    model = trainer.model_parts[0]
    return install_qk_clip(trainer.optimizers, model, n_layers=len(model.layers), tau=TAU)


def _runs(rank: int, world: int, folder: str) -> dict:
    from tests.torchtitan_cpu import seed_checkpoint, titan, train

    titan()
    from europa.flexshard.torchtitan import flexshard_config

    folder = Path(folder)
    seed = seed_checkpoint(_job(rank, world, folder, 2, "", "seed", STEPS), str(folder))
    fsdp: list = []
    fsdp_losses, _ = train(
        _job(rank, world, folder, 2, seed, "fsdp", STEPS), watch=_recording(fsdp, _installed)
    )
    flex: list = []
    job = flexshard_config(
        _job(rank, world, folder, 2, seed, "flexshard", STEPS), ranks_per_node=2, qk_clip_tau=TAU
    )
    flex_losses, _ = train(job, watch=_recording(flex, lambda t: t.optimizers.qk_clip))
    return {"fsdp": fsdp, "flexshard": flex, "fsdp_losses": fsdp_losses,
            "flexshard_losses": flex_losses}  # fmt: skip


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
