"""The TOML config: presets, files and ``--set`` overrides into typed, checked tables."""

from __future__ import annotations

import dataclasses
import datetime
import math
import tempfile
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from europa.core.config import (
    CORE_SECTIONS,
    ConfigSection,
    EuropaConfig,
    build_config,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
    preset_names,
    resolve_raw,
    setting,
)
from europa.core.config.fields import bounds_of
from europa.core.errors import ConfigError

PRESETS = ["debug", "kimi-k2", "small", "tiny"]


def render(value: Any) -> str:
    """A value as TOML text, the way a user would write it after ``--set key=``."""
    text = tomli_w.dumps({"v": value})
    assert text.startswith("v = ")
    return text.removeprefix("v = ").rstrip("\n")


def _load(overrides: list[str], **kwargs: Any) -> EuropaConfig:
    return load_config(None, overrides, **kwargs)


# -- strategies for valid configs -------------------------------------------------------

# Keys tied together by cross-field rules; drawn together, consistently, by _coupled.
COUPLED = {
    "run.name",
    "optimizer.name",
    "optimizer.qk_clip",
    "parallel.pp",
    "parallel.cp",
    "parallel.pp_schedule",
    "parallel.pp_stages_per_rank",
    "parallel.pp_overlap_f_b",
    "parallel.pp_layers",
    "model.num_experts",
    "model.top_k",
    "model.num_expert_groups",
    "model.num_limited_groups",
    "parallel.ep",
    "model.n_layers",
    "model.n_dense_layers",
    "model.max_seq_len",
    "training.seq_len",
    "parallel.dp_shard",
    "parallel.ep_dispatch",
    "parallel.ep_dispatch_dtype",
    "parallel.ep_max_nodes_per_token",
    "parallel.ep_keep_exchanges",  # needs activation checkpointing's table: not drawn here
    "parallel.dp_replicate",
    "fault_tolerance.enabled",
    "fault_tolerance.min_replicas",
    "fault_tolerance.process_group_timeout_s",
    "fault_tolerance.step_timeout_s",
    "fault_tolerance.join_timeout_s",
    "fault_tolerance.quorum_timeout_s",
    "fault_tolerance.heartbeat_timeout_s",
    "fault_tolerance.quorum_tick_s",
    "fault_tolerance.lighthouse",
}
INT64 = 2**63 - 1


def _value_strategy(annotation: Any, field: dataclasses.Field) -> st.SearchStrategy[Any]:
    """Any value the field's declared type, bounds and choices accept."""
    bounds = bounds_of(field)
    if bounds.choices is not None:
        return st.sampled_from(bounds.choices)
    if annotation is bool:
        return st.booleans()
    if annotation is str:
        return st.text(max_size=20)
    if typing.get_origin(annotation) is list:
        return st.lists(st.text(max_size=10), max_size=4)
    low = bounds.ge if bounds.ge is not None else bounds.gt
    if annotation is int:
        lo = -INT64 - 1 if low is None else int(low) + (bounds.gt is not None)
        hi = INT64 if bounds.le is None else int(bounds.le)
        return st.integers(lo, hi)
    assert annotation is float, annotation
    floats = st.floats(
        min_value=low,
        max_value=bounds.le,
        exclude_min=bounds.gt is not None,
        allow_nan=False,
        allow_infinity=False,
    )
    if bounds.ge is not None:
        int_lo = math.ceil(bounds.ge)
    elif bounds.gt is not None:
        int_lo = math.floor(bounds.gt) + 1
    else:
        int_lo = -(2**53)
    ints = st.integers(int_lo, 2**53 if bounds.le is None else math.floor(bounds.le))
    return st.one_of(floats, ints)


def _free_fields() -> list[tuple[str, st.SearchStrategy[Any]]]:
    out = []
    for section in CORE_SECTIONS:
        hints = typing.get_type_hints(section.schema)
        for field in dataclasses.fields(section.schema):
            key = f"{section.name}.{field.name}"
            if key not in COUPLED:
                out.append((key, _value_strategy(hints[field.name], field)))
    return out


FREE_FIELDS = _free_fields()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _coupled(draw: st.DrawFn) -> dict[str, Any]:
    """Keys bound by rules.py, drawn as consistent groups (each group all or nothing)."""
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        experts = draw(st.integers(1, 512))
        groups = limited = 0
        reachable = experts
        grouped = [g for g in _divisors(experts) if experts // g >= 2]
        if grouped and draw(st.booleans()):
            groups = draw(st.sampled_from(grouped))
            limited = draw(st.integers(1, groups))
            reachable = limited * (experts // groups)
        ep = draw(st.integers(1, experts))
        out |= {
            "model.num_experts": experts,
            "model.num_expert_groups": groups,
            "model.num_limited_groups": limited,
            "model.top_k": draw(st.integers(1, reachable)),
            "parallel.ep": ep,
        }
        if ep > 1 and draw(st.booleans()):  # the exchange keys need expert parallelism
            out["parallel.ep_dispatch"] = draw(st.sampled_from(["auto", "flat", "two_level"]))
            out["parallel.ep_dispatch_dtype"] = draw(
                st.sampled_from(["compute", "bfloat16", "float8_e4m3fn"])
            )
            if not groups and experts % ep == 0:  # the node limit sets the groups itself
                out["parallel.ep_max_nodes_per_token"] = draw(st.integers(0, 2**31))
    if draw(st.booleans()):
        layers = draw(st.integers(1, 200))
        out |= {"model.n_layers": layers, "model.n_dense_layers": draw(st.integers(0, layers - 1))}
    if draw(st.booleans()):
        max_seq_len = draw(st.integers(1, 2**20))
        seq_len = draw(st.integers(1, max_seq_len))
        out |= {"model.max_seq_len": max_seq_len, "training.seq_len": seq_len}
        cuts = [cp for cp in range(2, 65) if seq_len % (2 * cp) == 0]
        if cuts and draw(st.booleans()):  # context parallelism cuts a sequence in 2·cp
            out["parallel.cp"] = draw(st.sampled_from(cuts))
    if draw(st.booleans()):
        out["parallel.dp_shard"] = draw(st.one_of(st.just(-1), st.integers(1, 4096)))
    if draw(st.booleans()):  # a schedule and its stages per rank (pipelines: test_pipeline)
        schedule = draw(st.sampled_from(["1f1b", "interleaved-1f1b", "zbv", "dualpipev"]))
        own = {"1f1b": st.just(1), "zbv": st.just(2), "dualpipev": st.just(2)}
        per_rank = draw(st.one_of(st.just(0), own.get(schedule, st.integers(2, 8))))
        out |= {"parallel.pp_schedule": schedule, "parallel.pp_stages_per_rank": per_rank}
        # "on" needs stages (pp > 1) and a pairing schedule: test_pipeline's refusals
        out["parallel.pp_overlap_f_b"] = draw(st.sampled_from(["auto", "off"]))
    if draw(st.booleans()):  # replica groups, and fault tolerance's ladder of timeouts
        replicas = draw(st.integers(1, 64))
        out["parallel.dp_replicate"] = replicas
        if replicas > 1 and draw(st.booleans()):
            rungs = st.sets(st.integers(1, 10**6), min_size=2, max_size=2)
            collective, step = sorted(draw(rungs))
            tick, heartbeat = sorted(draw(rungs))
            join, quorum = (max(step, heartbeat) + rise for rise in sorted(draw(rungs)))
            port = draw(st.integers(1, 65535))
            out |= {
                "fault_tolerance.enabled": True,
                "fault_tolerance.min_replicas": draw(st.integers(1, replicas)),
                "fault_tolerance.lighthouse": draw(st.sampled_from(["", f"http://node7:{port}"])),
                "parallel.pp": 1,
                "plugins.enabled": [],
                "fault_tolerance.process_group_timeout_s": collective,
                "fault_tolerance.step_timeout_s": step,
                "fault_tolerance.quorum_tick_s": tick,
                "fault_tolerance.heartbeat_timeout_s": heartbeat,
                "fault_tolerance.join_timeout_s": join,
                "fault_tolerance.quorum_timeout_s": quorum,
            }
    if draw(st.booleans()):  # QK-clip needs Muon
        out["optimizer.name"] = draw(st.sampled_from(["adamw", "muon"]))
        out["optimizer.qk_clip"] = out["optimizer.name"] == "muon" and draw(st.booleans())
    if draw(st.booleans()):  # one folder name: UTF-8, non-empty, no "/" or NUL, <= 200 bytes
        letters = st.characters(exclude_characters="/\0", exclude_categories=["Cs"])
        name = draw(st.text(letters, min_size=1, max_size=50))
        out["run.name"] = name
    return out


@st.composite
def valid_overrides(draw: st.DrawFn) -> dict[str, Any]:
    """``{key: value}``: a random set of valid overrides over every core table."""
    chosen: dict[str, Any] = {}
    if draw(st.booleans()):
        chosen["preset"] = draw(st.sampled_from(PRESETS))
    for key, strategy in FREE_FIELDS:
        if draw(st.integers(0, 3)) == 0:
            chosen[key] = draw(strategy)
    return chosen | draw(_coupled())


# -- round trips --------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(valid_overrides())
def test_overrides_round_trip_through_the_resolved_toml(chosen):
    config = _load([f"{key}={render(value)}" for key, value in chosen.items()])
    assert config.preset == chosen.get("preset", "tiny")
    resolved = config_to_dict(config)
    for key, value in chosen.items():
        if key != "preset":
            table, name = key.split(".")
            assert resolved[table][name] == value, key
    for section in CORE_SECTIONS:
        hints = typing.get_type_hints(section.schema)
        for name, value in dataclasses.asdict(config.section(section.name)).items():
            expected = typing.get_origin(hints[name]) or hints[name]
            assert type(value) is expected, (section.name, name, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "resolved.toml"
        path.write_text(config_to_toml(config))
        assert load_config(path) == config


SCALARS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(),
    st.lists(st.text(), max_size=5),
    st.sampled_from([1e-8, 2.5e10, -3e-300, 1.7976931348623157e308, 5e-324, 0.0, -0.0]),
)
KEYS = st.lists(st.from_regex(r"[A-Za-z0-9_-]{1,8}", fullmatch=True), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(KEYS, SCALARS)
def test_parse_override_reads_back_any_rendered_toml_value(path, value):
    parsed_path, parsed = parse_override(f"{'.'.join(path)}={render(value)}")
    assert parsed_path == path
    assert parsed == value
    assert type(parsed) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, parsed) == math.copysign(1, value)


def test_parse_override_nan_and_spacing_and_bare_words():
    path, value = parse_override("optimizer.lr=nan")
    assert path == ["optimizer", "lr"] and math.isnan(value)
    assert parse_override("  training.steps =  7 ") == (["training", "steps"], 7)
    assert parse_override("data.path=/data/my corpus.jsonl") == (
        ["data", "path"],
        "/data/my corpus.jsonl",
    )
    assert parse_override("run.name=a=b") == (["run", "name"], "a=b")
    assert parse_override("optimizer.name='muon'") == (["optimizer", "name"], "muon")
    assert parse_override("optimizer.lr=1e-4") == (["optimizer", "lr"], 1e-4)
    assert parse_override('run.name="say \\"hi\\"\\n"') == (["run", "name"], 'say "hi"\n')
    assert parse_override("plugins.enabled=['a', \"b\"]") == (["plugins", "enabled"], ["a", "b"])


# -- presets and precedence -----------------------------------------------------------------


def test_preset_names():
    assert preset_names() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name, tmp_path):
    config = load_config(name)
    assert config.preset == name
    assert config.run.name == name
    assert config == load_config(None, [f"preset={name}"])
    path = tmp_path / "p.toml"
    path.write_text(f'preset = "{name}"\n')
    assert load_config(path) == config
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_default_is_tiny_and_presets_differ():
    tiny, debug, kimi = load_config(), load_config("debug"), load_config("kimi-k2")
    assert tiny == load_config("tiny")
    assert tiny.preset == "tiny" and tiny.model.dim == 128 and tiny.training.steps == 200
    assert debug.model.dim == 256 and debug.model.top_k == 3 and debug.training.steps == 50
    assert (kimi.model.dim, kimi.model.n_layers, kimi.model.num_experts) == (7168, 61, 384)
    assert (kimi.model.top_k, kimi.model.vocab_size) == (8, 163840)
    # defaults fill keys no preset sets
    assert tiny.optimizer.beta2 == 0.95 and tiny.plugins.enabled == []


def test_precedence_preset_then_file_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "debug"\n[training]\nsteps = 11\nbatch_size = 2\n')
    from_file = load_config(path)
    assert from_file.preset == "debug"
    assert from_file.model == load_config("debug").model  # the preset fills the rest
    assert (from_file.training.steps, from_file.training.batch_size) == (11, 2)
    assert from_file.training.seq_len == 256  # debug's, not tiny's 128

    overridden = load_config(path, ["training.steps=7"])
    assert (overridden.training.steps, overridden.training.batch_size) == (7, 2)

    # --set preset beats the file's preset; the file's own keys still apply on top
    switched = load_config(path, ["preset=tiny"])
    assert switched.preset == "tiny"
    assert switched.model == load_config("tiny").model
    assert (switched.training.steps, switched.training.seq_len) == (11, 128)


def test_file_without_preset_starts_from_tiny(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[optimizer]\nname = 'muon'\n")
    config = load_config(path)
    assert config.preset == "tiny"
    assert config.optimizer.name == "muon"
    assert dataclasses.replace(config, optimizer=load_config().optimizer) == load_config()


def test_a_file_named_like_a_preset_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("debug").write_text("[training]\nsteps = 3\n")
    config = load_config("debug")
    assert (config.preset, config.training.steps) == ("tiny", 3)


def test_plugins_argument_appends_to_plugins_enabled(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[plugins]\nenabled = ['a', 'b']\n")
    assert load_config(path, plugins=["b", "c"]).plugins.enabled == ["a", "b", "c"]
    raw = resolve_raw(None, ["plugins.enabled=['x']"], ["y"])
    assert raw["plugins"]["enabled"] == ["x", "y"] and raw["preset"] == "tiny"


def test_config_to_toml_is_the_whole_resolved_config():
    config = load_config("debug", ["optimizer.lr=1e-5"])
    parsed = tomllib.loads(config_to_toml(config))
    assert parsed == config_to_dict(config)
    assert parsed["preset"] == "debug" and parsed["optimizer"]["lr"] == 1e-5
    assert set(parsed) == {"preset"} | {s.name for s in CORE_SECTIONS}


# -- errors: exactly one line, naming key, value and what was expected ---------------------


@dataclass(kw_only=True)
class FakeConfig:
    level: int = setting(1, ge=0)


FAKE_SECTIONS = (*CORE_SECTIONS, ConfigSection("fake", FakeConfig, owner="fakeplugin"))
NO_FILE = object()
BAD_TOML = "[training\nsteps = 1\n"

BAD = [
    # (id, file text or None or NO_FILE, overrides, message; {path} is the file's path)
    (
        "unknown-key",
        None,
        ["model.top_kk=3"],
        "model.top_kk = 3: unknown key; did you mean model.top_k?",
    ),
    (
        "unknown-key-misspelled-table",
        None,
        ["trainig.steps=3"],
        "trainig.steps = 3: unknown key; did you mean training.steps?",
    ),
    (
        "unknown-key-too-deep",
        None,
        ["model.dim.x=1"],
        "model.dim.x = 1: unknown key; did you mean model.dim?",
    ),
    ("negative-steps", None, ["training.steps=-1"], "training.steps = -1: expected an integer > 0"),
    ("steps-word", None, ["training.steps=ten"], 'training.steps = "ten": expected an integer > 0'),
    ("steps-bool", None, ["training.steps=true"], "training.steps = true: expected an integer > 0"),
    (
        "top-k-over-experts",
        None,
        ["model.top_k=9"],
        "model.top_k = 9: expected at most model.num_experts (8)",
    ),
    (
        "optimizer-choice",
        None,
        ["optimizer.name=sgd"],
        'optimizer.name = "sgd": expected one of "adamw", "muon"',
    ),
    (
        "dtype-choice",
        None,
        ["training.dtype='float16'"],
        'training.dtype = "float16": expected one of "float32", "bfloat16"',
    ),
    (
        "ep-more-than-experts",
        None,
        ["parallel.ep=9"],
        "parallel.ep = 9: expected at most model.num_experts (8)",
    ),
    (
        "dp-shard-zero",
        None,
        ["parallel.dp_shard=0"],
        "parallel.dp_shard = 0: expected -1 (all remaining ranks) or an integer > 0",
    ),
    (
        "dp-shard-below",
        None,
        ["parallel.dp_shard=-2"],
        "parallel.dp_shard = -2: expected an integer >= -1",
    ),
    (
        "beta-range",
        None,
        ["optimizer.beta1=1.5"],
        "optimizer.beta1 = 1.5: expected a finite number between 0 and 1",
    ),
    (
        "rope-factor",
        None,
        ["model.rope_factor=0.5"],
        "model.rope_factor = 0.5: expected a finite number >= 1",
    ),
    ("lr-nan", None, ["optimizer.lr=nan"], "optimizer.lr = nan: expected a finite number > 0"),
    (
        "lr-minus-inf",
        None,
        ["optimizer.lr=-inf"],
        "optimizer.lr = -inf: expected a finite number > 0",
    ),
    ("lr-inf", None, ["optimizer.lr=inf"], "optimizer.lr = inf: expected a finite number > 0"),
    ("bool-as-int", None, ["model.route_norm=1"], "model.route_norm = 1: expected true or false"),
    ("name-is-date", None, ["run.name=2024-01-01"], "run.name = 2024-01-01: expected a string"),
    (
        "enabled-not-list",
        None,
        ["plugins.enabled=x"],
        'plugins.enabled = "x": expected a list of strings',
    ),
    (
        "enabled-mixed",
        None,
        ['plugins.enabled=[1, "a"]'],
        'plugins.enabled = [1, "a"]: expected a list of strings',
    ),
    (
        "enabled-dates",
        None,
        ["plugins.enabled=[2024-01-01, 07:32:00]"],
        "plugins.enabled = [2024-01-01, 07:32:00]: expected a list of strings",
    ),
    (
        "steps-table",
        None,
        ['training.steps={a=1, "b c"=[1.5, nan]}'],
        'training.steps = {a = 1, "b c" = [1.5, nan]}: expected an integer > 0',
    ),
    (
        "set-without-equals",
        None,
        ["foo"],
        '--set "foo": expected KEY=VALUE, e.g. training.steps=100',
    ),
    ("set-empty-key", None, ["=3"], '--set "=3": expected KEY=VALUE, e.g. training.steps=100'),
    (
        "set-empty-part",
        None,
        ["model..dim=3"],
        '--set "model..dim=3": expected KEY=VALUE, e.g. training.steps=100',
    ),
    (
        "set-preset-huge",
        None,
        ["preset=huge"],
        'preset = "huge": expected one of "debug", "kimi-k2", "small", "tiny"',
    ),
    ("set-preset-int", None, ["preset=3"], "preset = 3: expected a string"),
    (
        "limited-without-groups",
        None,
        ["model.num_limited_groups=1"],
        "model.num_limited_groups = 1: expected 0 when model.num_expert_groups is 0",
    ),
    (
        "groups-not-divisor",
        None,
        ["model.num_expert_groups=3", "model.num_limited_groups=1"],
        "model.num_expert_groups = 3: expected a divisor of model.num_experts (8)",
    ),
    (
        "groups-too-many",
        None,
        ["model.num_expert_groups=8", "model.num_limited_groups=1"],
        "model.num_expert_groups = 8: expected at most model.num_experts / 2 (4): "
        "each group needs 2 experts",
    ),
    (
        "limited-zero",
        None,
        ["model.num_expert_groups=4"],
        "model.num_limited_groups = 0: expected between 1 and model.num_expert_groups (4)",
    ),
    (
        "limited-over",
        None,
        ["model.num_expert_groups=4", "model.num_limited_groups=5"],
        "model.num_limited_groups = 5: expected between 1 and model.num_expert_groups (4)",
    ),
    (
        "top-k-unreachable",
        None,
        ["model.num_expert_groups=4", "model.num_limited_groups=1", "model.top_k=3"],
        "model.top_k = 3: expected at most the 2 experts the 1 limited groups hold",
    ),
    (
        "seq-len-over-max",
        None,
        ["training.seq_len=512"],
        "training.seq_len = 512: expected at most model.max_seq_len (256)",
    ),
    (
        "dense-layers",
        None,
        ["model.n_dense_layers=4"],
        "model.n_dense_layers = 4: expected less than model.n_layers (4) "
        "so that at least one layer is MoE",
    ),
    ("file-unknown-table", "[modle]\ndim = 3\n", [], "[modle]: unknown table; did you mean model?"),
    (
        "file-unknown-table-no-hint",
        "[zzzz]\nx = 1\n",
        [],
        "[zzzz]: unknown table; expected one of run, model, training, optimizer, "
        "lr_schedule, parallel, data, checkpoint, fault_tolerance, metrics, plugins",
    ),
    (
        "file-top-level-key",
        "steps = 3\n",
        [],
        "steps = 3: unknown key; did you mean training.steps?",
    ),
    (
        "file-float-steps",
        "[training]\nsteps = 1.5\n",
        [],
        "training.steps = 1.5: expected an integer > 0",
    ),
    ("file-table-is-scalar", "model = 3\n", [], "model = 3: expected a table"),
    (
        "file-preset-huge",
        'preset = "huge"\n',
        [],
        'preset = "huge": expected one of "debug", "kimi-k2", "small", "tiny"',
    ),
    ("file-preset-not-string", "preset = 3\n", [], "preset = 3: expected a string"),
    (
        "file-set-into-scalar",
        "training = 3\n",
        ["training.steps=2"],
        "training = 3: expected a table",
    ),
    (
        "file-bad-toml",
        BAD_TOML,
        [],
        'config = "{path}": invalid TOML '
        "(Expected ']' at the end of a table declaration (at line 1, column 10))",
    ),
    ("file-missing", NO_FILE, [], 'config = "{path}": expected a TOML file or a preset name'),
    (
        "file-then-set-wins-and-fails",
        "[training]\nsteps = 5\n",
        ["training.steps=0"],
        "training.steps = 0: expected an integer > 0",
    ),
]


@pytest.mark.parametrize(
    ("source", "overrides", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
def test_bad_config_is_one_line_naming_key_value_and_expectation(
    tmp_path, source, overrides, message
):
    path = tmp_path / "bad config.toml"
    if isinstance(source, str):
        path.write_text(source)
    with pytest.raises(ConfigError) as err:
        load_config(None if source is None else path, overrides)
    assert str(err.value) == message.replace("{path}", str(path))
    assert "\n" not in str(err.value)


def test_bad_message_ids_are_unique():
    assert len({c[0] for c in BAD}) == len(BAD) >= 12


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "model.vocab_size is missing: expected an integer > 0"),
        (
            {"model": {"vocab_size": 8}},
            "model.dim is missing: expected an integer > 0",
        ),
        ({"preset": "tiny", "modle": {}}, "[modle]: unknown table; did you mean model?"),
    ],
)
def test_build_config_on_raw_mappings(raw, message):
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert str(err.value) == message


def test_build_config_on_a_resolved_raw_mapping():
    raw = resolve_raw("tiny")
    assert build_config(raw) == load_config("tiny")
    del raw["training"]["steps"]
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert str(err.value) == "training.steps is missing: expected an integer > 0"
    raw["training"] = [1]
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert str(err.value) == "training = [1]: expected a table"


def test_plugin_owned_table_needs_its_plugin_enabled(tmp_path):
    message = (
        '[fake] is set but plugin "fakeplugin" is not enabled: '
        "expected fakeplugin in plugins.enabled (or -p fakeplugin)"
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fake.level=2"], sections=FAKE_SECTIONS)
    assert str(err.value) == message
    raw = resolve_raw(None, ["fake.level=2"], sections=FAKE_SECTIONS)
    with pytest.raises(ConfigError) as err:
        build_config(raw, FAKE_SECTIONS)
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fake.levle=2"], ["fakeplugin"], sections=FAKE_SECTIONS)
    assert str(err.value) == "fake.levle = 2: unknown key; did you mean fake.level?"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fake.level=-1"], ["fakeplugin"], sections=FAKE_SECTIONS)
    assert str(err.value) == "fake.level = -1: expected an integer >= 0"

    # Enabled: the table is typed, defaults filled, and the resolved TOML loads again.
    enabled = load_config(None, ["fake.level=2"], ["fakeplugin"], sections=FAKE_SECTIONS)
    assert enabled.section("fake") == FakeConfig(level=2)
    assert load_config(None, plugins=["fakeplugin"], sections=FAKE_SECTIONS).section(
        "fake"
    ) == FakeConfig(level=1)
    path = tmp_path / "resolved.toml"
    path.write_text(config_to_toml(enabled))
    assert load_config(path, sections=FAKE_SECTIONS) == enabled

    # Not enabled and not set: fine, and not written back (it would not load again).
    quiet = load_config(None, sections=FAKE_SECTIONS)
    assert "fake" not in quiet.extensions
    path.write_text(config_to_toml(quiet))
    assert load_config(path, sections=FAKE_SECTIONS) == quiet
    # A builtin owner's table is always active.
    owned = load_config(None, sections=FAKE_SECTIONS, builtin_owners=("europa-core", "fakeplugin"))
    assert owned.section("fake") == FakeConfig(level=1)


TOML_VALUES = st.recursive(
    st.one_of(
        st.integers(-(2**63), 2**63 - 1),
        st.floats(),
        st.booleans(),
        st.text(max_size=8),
        st.dates(),
        st.times(),
        st.datetimes(timezones=st.one_of(st.none(), st.just(datetime.UTC))),
    ),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)
ANY_KEY = st.one_of(
    st.sampled_from(
        ["preset"]
        + [f"{s.name}.{f.name}" for s in CORE_SECTIONS for f in dataclasses.fields(s.schema)]
    ),
    st.from_regex(r"[a-z_]{1,6}(\.[a-z_]{1,6}){0,2}", fullmatch=True),
)


@settings(max_examples=150, deadline=None)
@given(ANY_KEY, TOML_VALUES)
def test_any_override_loads_or_fails_in_one_line(key, value):
    try:
        _load([f"{key}={render(value)}"])
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message
        assert "expected" in message or "unknown key" in message, message
        if key.split(".")[0] not in {s.name for s in CORE_SECTIONS} | {"preset"}:
            assert message.startswith(f"{key} = "), message
