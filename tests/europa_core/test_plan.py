"""The planner on its own: hardware profiles, the FSDP2 layout's invariants,
the search, and the figures it hands to ``europa plan`` and ``europa train``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.core.errors import ConfigError, PluginError
from europa.core.model import build_moe_model
from europa.core.model.counting import ParameterCounts
from europa.core.plan import load_profile, make_plan, shipped_profiles
from europa.core.plan.activations import block_activations
from europa.core.plan.layout import fsdp2_layout
from europa.core.plan.memory import HostOffload, activations
from europa.core.plan.report import plan_json, plan_table
from europa.core.plan.search import smallest_replica
from europa.core.plan.shapes import ModelShapes, ParameterShape
from europa.core.session import open_session


def test_every_shipped_profile_loads():
    assert shipped_profiles() == ["cpu", "gh200-jupiter", "h100-sxm", "h200"]
    jupiter = load_profile("gh200-jupiter")
    assert (jupiter.gpus_per_node, jupiter.device_memory_gib, jupiter.host_memory_gib) == (
        4,
        96,
        120,
    )
    for name in shipped_profiles():
        assert load_profile(name).name == name


PROFILE = """name = "mine"
device = "cuda"
gpus_per_node = 2
device_memory_gib = 1.0
device_reserved_gib = 0.0
host_memory_gib = 4.0
peak_tflops = { bfloat16 = 100.0, float32 = 10.0 }
matmul_efficiency = 0.5
intra_node_gbps = 100.0
inter_node_gbps = 10.0
host_device_gbps = 50.0
link_efficiency = 0.8
"""


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda t: t + "colour = 'red'\n", "unknown key 'colour'"),
        (lambda t: t.replace("gpus_per_node = 2", "gpus_per_node = 0"), "gpus_per_node = 0"),
        (lambda t: t.replace('device = "cuda"', 'device = "tpu"'), "device = 'tpu'"),
        (lambda t: t.replace("matmul_efficiency = 0.5\n", ""), "missing key 'matmul_efficiency'"),
        (lambda t: t.replace("bfloat16 = 100.0, ", ""), "peak_tflops"),
        (lambda t: t + "[[", "not valid TOML"),
    ],
)
def test_a_bad_profile_is_refused_in_one_line(tmp_path, edit, words):
    path = tmp_path / "mine.toml"
    path.write_text(edit(PROFILE))
    with pytest.raises(ConfigError) as err:
        load_profile(str(path))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_users_profile_loads_and_an_unknown_name_lists_the_shipped_ones(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(PROFILE)
    mine = load_profile(str(path))
    assert (mine.name, mine.gpus_per_node, mine.attention_kernel) == ("mine", 2, "fused")
    with pytest.raises(ConfigError, match="expected one of cpu, gh200-jupiter, h100-sxm, h200"):
        load_profile("tpu-v5")


shapes_strategy = st.lists(
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=8
)


@given(shapes=shapes_strategy, ranks=st.integers(1, 12), muon=st.booleans())
def test_fsdp2_layout_holds_every_element_once_and_pads_at_most_a_row(shapes, ranks, muon):
    params = tuple(ParameterShape(f"layers.0.w{i}", s) for i, s in enumerate(shapes))
    total = sum(p.numel for p in params)
    model = ModelShapes(params, ParameterCounts(total, 0, total))
    layout = fsdp2_layout(model, ranks, "muon" if muon else "adamw")
    local = [m + a for m, a in zip(layout["muon_elements"], layout["adamw_elements"], strict=True)]
    assert sum(local) == total  # every element on exactly one rank
    assert len(set(layout["stored_elements"])) == 1  # padded: the same storage everywhere
    padding = ranks * layout["stored_elements"][0] - total
    assert 0 <= padding <= sum(math.prod(s[1:]) * (ranks - 1) for s in shapes)
    assert all(s >= n for s, n in zip(layout["stored_elements"], local, strict=True))
    assert layout["adamw_tensors"] == len(shapes) - (
        sum(1 for s in shapes if len(s) >= 2) if muon else 0
    )


def test_full_recomputation_keeps_block_inputs_and_one_block_live():
    config, _ = open_session("debug")
    blocks = block_activations(config.model, seq_len=64, batch=2, dtype_bytes=4)
    tokens = 128
    none = activations(blocks, tokens, recompute=False, offload=HostOffload())
    full = activations(blocks, tokens, recompute=True, offload=HostOffload())
    inputs = sum(b.input_bytes_per_token * tokens for b in blocks[:-1])
    largest = max(b.saved_bytes(tokens) for b in blocks[:-1])
    assert full.device == inputs + blocks[-1].saved_bytes(tokens) + largest
    assert none.device == sum(b.saved_bytes(tokens) for b in blocks) > full.device


def test_offload_moves_large_tensors_of_all_but_the_last_blocks():
    config, _ = open_session("debug")
    blocks = block_activations(config.model, seq_len=64, batch=2, dtype_bytes=4)
    offload = HostOffload(activation_blocks=("layers.*",), keep_last_blocks=1, min_tensor_bytes=1)
    moved = activations(blocks, 128, recompute=False, offload=offload)
    assert moved.host == sum(b.saved_bytes(128) for b in blocks[:-2])
    assert moved.device + moved.host == sum(b.saved_bytes(128) for b in blocks)


def _tight_cpu(tmp_path, gib: float):
    path = tmp_path / "small.toml"
    path.write_text(PROFILE.replace("device_memory_gib = 1.0", f"device_memory_gib = {gib}"))
    return load_profile(str(path))


def test_the_smallest_replica_that_fits(tmp_path):
    config, plugins = open_session("debug", ["training.batch_size=1", "training.seq_len=32"])
    model = build_moe_model(config.model)
    roomy = _tight_cpu(tmp_path, 100.0)
    at_eight = make_plan(config, plugins, roomy, 8, model=model).device_total
    hardware = _tight_cpu(tmp_path, at_eight / 2**30)  # 8 ranks (4 nodes of 2) just fit

    def plan_for(cfg, ranks):
        return make_plan(cfg, plugins, hardware, ranks, model=model)

    assert not plan_for(config, 2).fits
    found, note = smallest_replica(config, plan_for, hardware.gpus_per_node)
    assert found.fits and found.world_size <= 8
    assert not plan_for(config, found.world_size - 2).fits
    assert f"smallest replica that fits the config as given is {found.world_size} GPU(s)" in note


def test_core_fsdp2_has_no_expert_parallelism_in_the_plan_either():
    config, plugins = open_session("tiny", ["parallel.ep=2"])
    with pytest.raises(PluginError, match=r"parallel\.ep = 2: core's FSDP2 layout"):
        make_plan(config, plugins, load_profile("cpu"), 2)


@pytest.mark.parametrize(
    ("dtype", "ranks", "replicas", "form"),
    [
        ("float32", 1, 1, "plain"),
        ("bfloat16", 1, 1, "fsdp2"),
        ("float32", 2, 1, "fsdp2"),
        ("float32", 2, 2, "ddp"),
        ("float32", 4, 2, "hsdp"),
    ],
)
def test_the_plan_gathers_blocks_only_where_fsdp2_wraps_the_model(dtype, ranks, replicas, form):
    # fp32 with dp_shard = 1 trains plain or DDP (plugins/builtin/fsdp.py): no gathered
    # block, no unsharded gradient buffer beside the gradients themselves.
    overrides = [f'training.dtype="{dtype}"', f"parallel.dp_replicate={replicas}"]
    config, plugins = open_session("tiny", overrides)
    plan = make_plan(config, plugins, load_profile("cpu"), ranks)
    transient = plan.device_terms["gathered_parameters"] + plan.device_terms["gradient_buffers"]
    gathers = form in ("fsdp2", "hsdp")
    assert (transient > 0) == gathers
    assert bool(plan.layout["gathered_unit_elements"]) == gathers
    assert plan_json(plan)["layout_form"] == form
    assert plan_table(plan).splitlines()[0].endswith(f"layout core.fsdp2 ({form})")


def test_the_checkpoint_is_planned_once_whatever_the_copies_and_timed_by_the_file_system():
    import dataclasses

    from europa.core.plan import load_profile, make_plan

    hardware = load_profile("gh200-jupiter")
    sizes = {}
    for replicas in (1, 2):
        config, plugins = open_session("debug", [f"parallel.dp_replicate={replicas}"], [])
        sizes[replicas] = make_plan(config, plugins, hardware, 8).checkpoint_bytes
    assert sizes[1] == sizes[2] > 0  # each byte once: replicas add nothing
    config, plugins = open_session("debug")
    assert make_plan(config, plugins, hardware, 8).checkpoint_write_s is None  # not given
    timed = make_plan(config, plugins, dataclasses.replace(hardware, filesystem_gbps=2.0), 8)
    assert timed.checkpoint_write_s == pytest.approx(timed.checkpoint_bytes / 2 / 2e9)  # 2 nodes
