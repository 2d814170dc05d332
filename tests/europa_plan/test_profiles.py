"""The built-in hardware profiles: every GPU the issue names, each figure present and
cited, dense peaks (half NVIDIA's sparse table figures), an NVL72 rack one node of 72."""

from __future__ import annotations

import pytest

from europa.plan import load_runs


@pytest.fixture(scope="module")
def builtins(tmp_path_factory):
    """What an empty runs file knows: the built-ins alone."""
    empty = tmp_path_factory.mktemp("runs") / "empty.toml"
    empty.write_text("")
    return load_runs(empty)


NAMED = {"h800-sxm", "h100-sxm", "h200", "gh200-jupiter", "b200", "gb200-nvl72", "gb300-nvl72"}


def test_every_named_gpu_is_built_in_with_its_sources(builtins):
    gpus = builtins.gpus
    assert set(gpus) >= NAMED
    for gpu in gpus.values():
        assert gpu.source and gpu.peak_tflops["bfloat16"] > 0, gpu.id
        # FP8 runs twice BF16's rate (989 is 1979 / 2 rounded down, as NVIDIA prints it)
        assert gpu.peak_tflops["float8"] == pytest.approx(2 * gpu.peak_tflops["bfloat16"], 1e-3)
        assert gpu.hbm_gb > 0 and gpu.hbm_tbps > 0 and gpu.network_gbps < gpu.nvlink_gbps


def test_the_figures_that_set_the_seed_and_the_blackwell_racks(builtins):
    gpus = builtins.gpus
    jupiter = gpus["gh200-jupiter"]
    assert (jupiter.gpus_per_node, jupiter.hbm_gb, jupiter.network_gbps) == (4, 96, 25.0)
    for rack in ("gb200-nvl72", "gb300-nvl72"):
        assert gpus[rack].gpus_per_node == 72 and "mxfp8" in gpus[rack].peak_tflops
    assert "mxfp8" not in gpus["h100-sxm"].peak_tflops  # Hopper has no MX formats
    assert gpus["h800-sxm"].nvlink_gbps < gpus["h100-sxm"].nvlink_gbps


def test_kimi_k2_is_built_in_with_its_published_shape(builtins):
    kimi = builtins.models["kimi-k2"]
    assert (kimi.n_layers, kimi.num_experts, kimi.top_k, kimi.vocab_size) == (61, 384, 8, 163840)


def test_every_gpu_of_a_generation_shares_its_efficiencies(builtins):
    generations = {gpu.generation for gpu in builtins.gpus.values()}
    assert generations == {"hopper", "blackwell"} == set(builtins.generations)
    for gpu in builtins.gpus.values():
        efficiencies = builtins.generations[gpu.generation]
        assert set(efficiencies.gemm) >= set(gpu.peak_tflops) - {"float32"}, gpu.id


def test_a_file_gpu_overrides_only_the_keys_it_states(tmp_path):
    path = tmp_path / "runs.toml"
    path.write_text('[[gpu]]\nid = "h100-sxm"\nhbm_gb = 94\n')
    gpu = load_runs(path).gpus["h100-sxm"]
    assert (gpu.hbm_gb, gpu.sm_count, gpu.generation) == (94, 132, "hopper")
