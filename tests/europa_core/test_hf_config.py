"""Hugging Face config mapping, block-FP8 dequantisation and the meta-device import
plan of the kimi-k2 shape (no transformers needed here)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from europa.cli.app import run
from europa.core.config import load_config
from europa.core.errors import CheckpointError, ConfigError
from europa.core.hf.config_map import (
    check_model_matches,
    hf_config_from_model,
    model_table_from_hf,
)
from europa.core.hf.reader import HFCheckpoint


@pytest.mark.parametrize("preset", ["tiny", "debug", "kimi-k2"])
def test_config_round_trip(preset):
    model = load_config(preset).model
    table = model_table_from_hf(hf_config_from_model(model), "config.json")
    check_model_matches(model, table, "config.json")  # every weight-describing key equal


def _deepseek_v3() -> dict:
    """DeepSeek-V3's published config.json keys that matter here (legacy rope keys)."""
    config = hf_config_from_model(load_config("kimi-k2").model)
    return config | {
        "n_routed_experts": 256,
        "n_group": 8,
        "topk_group": 4,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "num_nextn_predict_layers": 1,
    }


def test_group_limited_routing_and_yarn_map():
    table = model_table_from_hf(_deepseek_v3(), "c")
    assert (table["num_expert_groups"], table["num_limited_groups"]) == (8, 4)
    assert (table["rope_factor"], table["mscale"], table["rope_beta_fast"]) == (40.0, 1.0, 32.0)
    one_group = model_table_from_hf(_deepseek_v3() | {"n_group": 1, "topk_group": 1}, "c")
    assert (one_group["num_expert_groups"], one_group["num_limited_groups"]) == (0, 0)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"scoring_func": "softmax"}, 'scoring_func = "softmax": expected "sigmoid"'),
        ({"rope_interleave": False}, "rope_interleave = false: expected true"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings = true"),
        ({"n_shared_experts": 0}, "n_shared_experts = 0: expected at least 1"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_what_cannot_map_is_refused_in_one_line(change, words, tmp_path):
    config = _deepseek_v3() | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(words)) as err:
        model_table_from_hf(config, "c")  # the config alone
        HFCheckpoint(tmp_path)  # quantization is the reader's to judge
    assert "\n" not in str(err.value)


def test_yarn_attention_factor_must_be_one():
    config = _deepseek_v3()
    config["rope_scaling"] = config["rope_scaling"] | {"mscale": 0.7}
    with pytest.raises(CheckpointError, match="expected equal to mscale_all_dim"):
        model_table_from_hf(config, "c")


def test_export_refuses_a_softmax_router():
    model = load_config("tiny", ['model.score_func="softmax"']).model
    with pytest.raises(ConfigError, match=re.escape('model.score_func = "softmax"')):
        hf_config_from_model(model)


def test_block_fp8_is_dequantised_slice_by_slice(tmp_path):
    block = 128
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(300, 200, generator=generator)
    scales = torch.rand(3, 2, generator=generator) + 0.5  # one per 128 x 128 block
    per_element = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[:300, :200]
    fp8 = (full / per_element).to(torch.float8_e4m3fn)
    save_file({"w": fp8, "w_scale_inv": scales}, tmp_path / "model.safetensors")
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (tmp_path / "config.json").write_text(
        json.dumps(_deepseek_v3() | {"quantization_config": quant})
    )
    checkpoint = HFCheckpoint(tmp_path)
    whole = checkpoint.read("w")
    assert whole.dtype == torch.float32
    assert torch.equal(whole, fp8.float() * per_element)
    region = (slice(100, 290), slice(7, 150))  # crosses block edges on both axes
    assert torch.equal(checkpoint.read("w", region), whole[region])


def test_kimi_k2_import_is_planned_on_the_meta_device(tmp_path, capsys):
    assert run(["config", "to-hf", "kimi-k2", "--dtype", "bfloat16"]) == 0
    (tmp_path / "config.json").write_text(capsys.readouterr().out)
    assert run(["import-hf", str(tmp_path), "kimi-k2", "--nproc", "384"]) == 0
    out = capsys.readouterr().out
    assert "69975 Hugging Face tensors (1.87 TiB at 2 byte(s) an element)" in out
    assert "layers.{L}.moe.routed_experts.inner_experts.w1_EFD <- " in out
    assert "model.layers.{L}.mlp.experts.{E}.gate_proj.weight  (23040 tensors" in out
    assert "bytes read per rank over 384 rank(s): max 4.98 GiB" in out


def test_init_from_other_than_hf_is_refused_before_launch(tmp_path, capsys):
    argv = ["train", "--set", 'model.init_from="s3:bucket"', "--nproc", "1"]
    assert run([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    assert 'model.init_from = "s3:bucket": expected "" (random' in capsys.readouterr().err
