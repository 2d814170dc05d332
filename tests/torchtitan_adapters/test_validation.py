"""torchtitan's validation loop (its ``Validator``, every few steps) with europa-flexshard in
place of FSDP2, on 2 gloo ranks with ``ep`` = 2: the validation loss flexshard's layout
computes equals torchtitan's FSDP2 + EP's on the same weights and held-out batches, and
validating leaves training as it was (the same losses as a flexshard run that never
validates)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import run_ranks

STEPS = 6
EVERY = 3  # validated at steps 1, 3 and 6 (torchtitan: step 1, each multiple, the last)
BATCHES = 2
HELD_OUT = 10_000  # validation reads the preset's batches from here on
RELATIVE = 1e-5


def _with_validation(config):
    from torchtitan.components.validate import Validator

    from tests.torchtitan_cpu import titan

    batches = titan().EuropaBatches

    @dataclass(kw_only=True, slots=True)
    class HeldOut(batches.Config):
        infinite: bool = True  # torchtitan's Validator sets it

        def build(self, **kwargs):
            loader = batches(self, **kwargs)
            loader.step = HELD_OUT
            return loader

    train_data = config.dataloader
    config.validator = Validator.Config(
        enable=True,
        freq=EVERY,
        steps=BATCHES,
        dataloader=HeldOut(preset=train_data.preset, overrides=train_data.overrides,
                           cache_dir=train_data.cache_dir),
    )  # fmt: skip
    return config


def _recording(record: list):
    def watch(trainer) -> None:
        log = trainer.metrics_processor.log_validation

        def logged(loss: float, step: int, **kwargs):
            record.append((step, loss))
            return log(loss=loss, step=step, **kwargs)

        trainer.metrics_processor.log_validation = logged

    return watch


def _runs(rank: int, world: int, folder: str) -> dict:
    from tests.torchtitan_adapters.test_flexshard import _flexshard, _job, _node_limited
    from tests.torchtitan_cpu import seed_checkpoint, titan, train

    titan()
    folder = Path(folder)
    seed = seed_checkpoint(_job(rank, world, folder, 2, "", "seed"), str(folder))
    out: dict = {}
    for name, layout in (("fsdp", _node_limited), ("flexshard", lambda c: _flexshard(c, 2))):
        validated: list = []
        job = layout(_with_validation(_job(rank, world, folder, 2, seed, name, STEPS)))
        losses, _ = train(job, watch=_recording(validated))
        out[name] = {"losses": losses, "validation": validated}
    out["flexshard_alone"], _ = train(_flexshard(_job(rank, world, folder, 2, seed, "alone",
                                                      STEPS), 2))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("validation")), timeout=300)


@pytest.mark.distributed
def test_flexshard_validates_as_fsdp2_and_validation_leaves_training_alone(ranks):
    for rank in ranks:
        fsdp, flexshard = rank["fsdp"]["validation"], rank["flexshard"]["validation"]
        assert [step for step, _ in fsdp] == [1, 3, 6]
        assert [step for step, _ in flexshard] == [1, 3, 6]
        for (_, expected), (_, got) in zip(fsdp, flexshard, strict=True):
            assert abs(got - expected) <= RELATIVE * abs(expected), (fsdp, flexshard)
        assert len({loss for _, loss in flexshard}) == 3  # the weights moved between them
        assert rank["flexshard"]["losses"] == rank["flexshard_alone"]
        for a, b in zip(rank["fsdp"]["losses"], rank["flexshard"]["losses"], strict=True):
            assert abs(a - b) <= RELATIVE * abs(b)
