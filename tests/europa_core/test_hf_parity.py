"""Hugging Face checkpoints in and out, checked against ``transformers``' own
DeepSeek-V3 (tests/hf_reference.py): logits equal within 1e-4 relative in fp32,
on 1 process and on 2 gloo ranks under FSDP2 and FlexShard (with and without
expert parallelism)."""

from __future__ import annotations

import math

import pytest
import torch

from europa.core.hf.export import export_hf
from europa.core.hf.reader import HFCheckpoint
from tests.hf_reference import (
    TOLERANCE,
    hf_logits,
    import_train_export,
    model_overrides,
    relative_error,
    save_reference,
    tokens,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "reference"
    logits = save_reference(directory, max_shard_size="200KB")  # several shards and an index
    return directory, logits


def _one_process_model(directory):
    from europa.core.hf.load import load_buffers, open_initialiser
    from europa.core.model import build_moe_model, init_buffers, model_spec
    from europa.core.model.materialise import init_parameters
    from europa.core.session import open_session

    config, _ = open_session("tiny", model_overrides(directory))
    model = build_moe_model(config.model)
    init = open_initialiser(model, model_spec(config.model), config.model)
    init_parameters(model, torch.device("cpu"), init)  # core's europa_init_parameters, 1 process
    init_buffers(model, torch.device("cpu"))
    load_buffers(model, init)
    return config, model.eval(), init


def test_one_process_import_and_export_match_transformers(reference, tmp_path):
    from europa.core.run_dir import prepare_run_dir
    from europa.core.train.checkpoint import TorchDistributedState, save_checkpoint

    directory, expected = reference
    config, model, init = _one_process_model(directory)
    with torch.no_grad():
        assert relative_error(model(tokens()), expected) < TOLERANCE
        total = sum(math.prod(s.shape) * 4 for srcs in init.sources.values() for s in srcs)
        buffers = sum(b.numel() * 4 for n, b in model.named_buffers() if "expert_bias" in n)
        assert init.bytes_read == total - buffers  # every parameter matrix read once

        generator = torch.Generator().manual_seed(2)  # move away from the imported weights
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
        ours = model(tokens())
    run_dir = tmp_path / "run"
    prepare_run_dir(config, run_dir, resume=False)
    state = TorchDistributedState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    save_checkpoint(run_dir, 1, state, {"step": 1})
    done = export_hf(run_dir, tmp_path / "out", max_shard_bytes=100_000)
    assert done["files"] > 1
    assert relative_error(hf_logits(tmp_path / "out"), ours) < TOLERANCE


@pytest.mark.distributed
def test_two_ranks_fsdp2_and_flexshard_import_and_export_match_transformers(
    reference, tmp_path, ranks
):
    directory, expected = reference
    runs = [
        ("fsdp2", [], []),
        ("flexshard", ["flexshard"], ["flexshard.log_plan=false"]),
        ("flexshard-ep", ["flexshard"], ["flexshard.log_plan=false", "parallel.ep=2"]),
    ]
    results = ranks(import_train_export, 2, str(tmp_path), str(directory), runs, timeout=240)[0]
    checkpoint = HFCheckpoint(directory)
    biases = {k for k in checkpoint.tensors if k.endswith("e_score_correction_bias")}
    parameter_bytes = sum(
        math.prod(i.shape) * 4 for k, i in checkpoint.tensors.items() if k not in biases
    )
    for name, _, _ in runs:
        got = results[name]
        assert relative_error(got["imported"], expected) < TOLERANCE, name
        # Each rank read only what it holds: together, every matrix exactly once.
        assert sum(got["bytes_read"]) == parameter_bytes, name
        assert max(got["bytes_read"]) < 0.8 * parameter_bytes, name
        out = tmp_path / f"{name}-hf"
        export_hf(tmp_path / name, out, max_shard_bytes=300_000)
        assert relative_error(hf_logits(out), got["trained"]) < TOLERANCE, name
        assert relative_error(got["trained"], got["imported"]) > TOLERANCE, name  # it trained
