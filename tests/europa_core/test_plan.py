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
from europa.core.plan.builtin_layouts import fsdp2_layout
from europa.core.plan.checkpoint_cost import lost_per_save
from europa.core.plan.memory import activations
from europa.core.plan.report import plan_json, plan_table
from europa.core.plan.search import smallest_replica
from europa.core.plan.shapes import ModelShapes, ParameterShape
from europa.core.session import open_session
from europa.spec.offload import HostOffload
from europa.spec.units import human


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
        (lambda t: t + "[[", "invalid TOML"),
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


def _debug_plan(overrides=(), plugins=(), hardware="gh200-jupiter", ranks=8, **profile):
    import dataclasses

    config, manager = open_session("debug", list(overrides), list(plugins))
    profile_ = dataclasses.replace(load_profile(hardware), **profile)
    return make_plan(config, manager, profile_, ranks)


@pytest.mark.parametrize("replicas", [1, 2, 8])  # FSDP2, HSDP, DDP
def test_an_async_save_stages_the_ranks_own_state_in_host_memory(replicas):
    layout = [f"parallel.dp_replicate={replicas}"]
    sync = _debug_plan(layout)
    plan = _debug_plan([*layout, 'checkpoint.mode="async"'])
    rank = plan.state.most_loaded()
    held = plan.state.parameters[rank] + plan.state.optimizer_state[rank]
    assert plan.checkpoint_staging_bytes == plan.host_terms["checkpoint_staging"] == held
    assert plan.host_total == sync.host_total + held
    assert sync.checkpoint_staging_bytes == sync.host_terms["checkpoint_staging"] == 0
    assert sync.checkpoint_stage_bytes == held  # what async would stage, for the comparison
    assert held >= plan.checkpoint_bytes / plan.world_size  # each rank's share, copies and all
    # a copy out of the GPU, at GH200's measured device-to-host rate (170 GB/s), not C2C's peak
    assert plan.checkpoint_stage_s == pytest.approx(held / 170e9)
    assert plan_json(plan)["checkpoint"]["staging_bytes_per_rank"] == held
    cpu = _debug_plan(['checkpoint.mode="async"'], hardware="cpu", ranks=2)
    assert "checkpoint_staging" not in cpu.host_terms  # a CPU rank's host is its RAM
    assert cpu.device_terms["checkpoint_staging"] > 0


def test_async_staging_over_the_host_memory_is_refused_in_one_line():
    state = ["offload.optimizer_state=true"]
    sync = _debug_plan(state, ["offload"])
    stage = sync.checkpoint_stage_bytes
    room = (sync.host_total + stage / 2) / 2**30  # room for the offload, not for staging too
    assert _debug_plan(state, ["offload"], host_memory_gib=room).fits
    plan = _debug_plan([*state, 'checkpoint.mode="async"'], ["offload"], host_memory_gib=room)
    assert plan.fits_device and not plan.fits_host and not plan.fits
    moved, optimizer = plan.host_terms["activations"], plan.host_terms["optimizer_state"]
    assert plan.refusal() == (
        f"debug: 8 rank(s) on gh200-jupiter: each rank needs {human(moved + optimizer + stage)} "
        f"of host memory, {human(moved + optimizer)} offload (activations {human(moved)}, "
        f"optimizer_state {human(optimizer)}) + "
        f'{human(stage)} checkpoint staging (checkpoint.mode = "async"), and has '
        f'{human(int(room * 2**30))}: expected checkpoint.mode = "sync", more ranks, a larger '
        "budget, or less offloaded"
    )
    assert "does not fit: " + plan.refusal() in plan_table(plan)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("every", [0, 1, 10**6])
def test_the_time_each_save_loses_in_each_mode(mode, every):
    sets = [f'checkpoint.mode="{mode}"', f"checkpoint.every={every}"]
    plan = _debug_plan(sets, filesystem_gbps=2.0)
    write, stage = plan.checkpoint_write_s, plan.checkpoint_stage_s
    assert write == pytest.approx(plan.checkpoint_bytes / 2 / 2e9)  # 2 nodes of 4
    between = every * plan.step.step_s
    exposed = write if every == 0 else max(0.0, write - between)  # 0: the final save's write
    assert plan.checkpoint_lost_s == pytest.approx({"sync": write, "async": stage + exposed})
    if every == 10**6:
        assert plan.checkpoint_lost_s["async"] == pytest.approx(stage)  # the write is hidden
    report = plan_json(plan)["checkpoint"]
    assert (report["mode"], report["lost_s"]) == (mode, plan.checkpoint_lost_s)
    assert f"{mode} (configured)" in plan_table(plan)
    unknown = _debug_plan(sets)
    assert unknown.checkpoint_lost_s == {"sync": None, "async": None}
    assert "unknown" in plan_table(unknown)


def test_the_write_cap_of_each_rank_slows_a_faster_file_system():
    plan = _debug_plan(["checkpoint.max_write_mbps=100"], filesystem_gbps=2.0)
    assert plan.checkpoint_write_s == pytest.approx(plan.checkpoint_bytes / 2 / (4 * 100e6))


@given(
    write=st.floats(0, 1e4),
    staging=st.floats(0, 1e3),
    every=st.integers(0, 10**4),
    step=st.floats(1e-3, 1e3),
)
def test_an_async_save_never_loses_more_than_a_sync_one_and_its_staging(
    write, staging, every, step
):
    lost = lost_per_save(write, staging, every, step)
    assert staging <= lost["async"] <= lost["sync"] + staging
    assert lost_per_save(None, staging, every, step) == {"sync": None, "async": None}


@given(
    sizes=st.lists(st.integers(1, 10**6), min_size=1, max_size=8),
    root=st.integers(0, 10**6),
    compute_bytes=st.sampled_from([2, 4]),
)
def test_blocks_kept_gathered_to_backward_are_counted_whole(sizes, root, compute_bytes):
    from europa.core.plan.memory import kept_blocks
    from europa.core.plan.moments import RankMemory, device_moments

    units = {f"layers.{i}": n for i, n in enumerate(sizes)} | {"<root>": root}
    gathered = {}
    for policy in ("all", "all_but_last", "none"):
        layout = {"gathered_unit_elements": units, "gather_group_size": 1}
        moments = device_moments(
            layout,
            RankMemory(0, 0, 0, 0, 0, 0),
            compute_bytes=compute_bytes,
            reduce_bytes=4,
            activations=0,
            recomputed=0,
            expert_buffers=0,
            kept_blocks=kept_blocks(units, policy),
            micro_batches=1,
        )
        most = max(m.terms.get("gathered_parameters", 0) for m in moments)
        gathered[policy] = most // compute_bytes
    assert kept_blocks(units, "all") == []
    assert kept_blocks(units, "all_but_last") == [f"layers.{len(sizes) - 1}"]
    assert kept_blocks(units, "none") == [f"layers.{i}" for i in range(len(sizes))]
    # the root (gathered from the start of forward to the end of backward), the block in use
    # and the one prefetched
    assert gathered["all"] == root + 2 * max(sizes)
    assert gathered["all"] <= gathered["all_but_last"] <= gathered["none"]
    assert gathered["all_but_last"] >= root + sizes[-1] + max(sizes)
    assert gathered["none"] >= sum(sizes) + root


def test_the_plan_counts_the_blocks_overlap_keeps_gathered_to_backward():
    # overlap.reshard_after_forward = "none" keeps every block's gathered parameters from its
    # forward to its backward: the plan's device memory holds them all.
    plans = {
        policy: _debug_plan(
            ["parallel.ep=2", f'overlap.reshard_after_forward="{policy}"'],
            ["flexshard", "overlap"],
            hardware="cpu",
            ranks=2,
        )
        for policy in ("all", "none")
    }
    units = plans["none"].layout["gathered_unit_elements"]
    blocks = sum(n for unit, n in units.items() if unit != "<root>")
    kept = plans["none"].device_terms["gathered_parameters"]
    assert kept >= 4 * blocks > plans["all"].device_terms["gathered_parameters"]
    assert plans["none"].device_total - plans["all"].device_total == (
        kept - plans["all"].device_terms["gathered_parameters"]
    )
