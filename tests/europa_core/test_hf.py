"""Hugging Face checkpoints in and out, checked against ``transformers``' own
DeepSeek-V3 (tests/hf_reference.py): logits equal within 1e-4 relative in fp32,
on 1 process and on 2 gloo ranks under FSDP2 and FlexShard (with and without
expert parallelism)."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    from europa.core.checkpoint.store import TorchDistributedState, save_checkpoint
    from europa.core.launch.prepare import prepare_run_dir

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


# -- bad input: one line, exit 2 ------------------------------------------------------------


def _copy(reference, tmp_path):
    import shutil

    return Path(shutil.copytree(reference[0], tmp_path / "ck"))


def _fails(capsys, *argv) -> str:
    from europa.cli.app import run

    assert run(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("europa: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_not_a_checkpoint_is_one_line(tmp_path, capsys):
    assert "has no config.json" in _fails(capsys, "import-hf", str(tmp_path))
    assert "is not a directory" in _fails(capsys, "import-hf", str(tmp_path / "nothing"))


def test_architecture_mismatch_is_one_line(reference, tmp_path, capsys):
    ck = _copy(reference, tmp_path)
    config = json.loads((ck / "config.json").read_text())
    config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (ck / "config.json").write_text(json.dumps(config))
    assert "expected DeepseekV3ForCausalLM" in _fails(capsys, "import-hf", str(ck))


def test_missing_shard_is_one_line(reference, tmp_path, capsys):
    ck = _copy(reference, tmp_path)
    (ck / "model-00002-of-00005.safetensors").unlink()
    err = _fails(capsys, "import-hf", str(ck))
    assert "model-00002-of-00005.safetensors" in err and "is missing" in err


def test_shape_mismatch_names_the_tensor_and_both_shapes(reference, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    ck = _copy(reference, tmp_path)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = ck / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    err = _fails(capsys, "import-hf", str(ck))
    assert key in err and "[32, 63]" in err and "[32, 64]" in err


def test_config_mismatch_names_the_key(reference, capsys):
    err = _fails(capsys, "import-hf", str(reference[0]), "--set", "model.top_k=1")
    assert "model.top_k = 1" in err and "gives 2" in err


def test_training_from_a_bad_checkpoint_fails_before_launching(tmp_path, capsys):
    err = _fails(capsys, "train", "--set", f'model.init_from="hf:{tmp_path}"', "--nproc", "1",
                 "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert "has no config.json" in err and not (tmp_path / "run").exists()
