"""From TOML text to a checked ``EuropaConfig``.

Order of precedence, lowest first: the preset named by the file's top-level
``preset`` key (``tiny`` when absent), the file itself, then ``--set`` overrides.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from europa.core.config import toml
from europa.core.config.fields import ConfigSection
from europa.core.config.rules import check_cross_field_rules
from europa.core.config.schema import CORE_SECTIONS, EuropaConfig
from europa.core.config.values import coerce, describe, fail, show
from europa.core.errors import ConfigError

DEFAULT_PRESET = "tiny"
CORE_OWNER = "europa-core"


def preset_names() -> list[str]:
    return list(_preset_names())


@functools.cache  # the package's files: read once (a layout search loads thousands of configs)
def _preset_names() -> tuple[str, ...]:
    presets = resources.files("europa.core.config.presets")
    return tuple(
        sorted(p.name.removesuffix(".toml") for p in presets.iterdir() if p.name.endswith(".toml"))
    )


def _read_preset(name: str) -> dict[str, Any]:
    if name not in _preset_names():
        raise fail("preset", name, "one of " + ", ".join(show(n) for n in _preset_names()))
    return copy.deepcopy(_parsed_preset(name))  # the caller's to change


@functools.cache
def _parsed_preset(name: str) -> dict[str, Any]:
    data = resources.files("europa.core.config.presets").joinpath(f"{name}.toml").read_bytes()
    return toml.from_bytes(data, f"preset = {show(name)}")


def read_toml_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    shown = show(str(path))
    if not path.is_file():
        raise ConfigError(f"config = {shown}: expected a TOML file or a preset name")
    return toml.read_file(path, f"config = {shown}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value). The value is read as TOML; a bare
    word that is not valid TOML (a path, a name) is taken as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {show(text)}: expected KEY=VALUE, e.g. training.steps=100")
    try:
        value = copy.deepcopy(_override_value(raw.strip()))  # the caller's to change
    except toml.IntegerRangeError as err:  # "v[2]" is the --set key's item 2
        where = toml.dotted([key, *err.path[1:]])
        raise ConfigError(f"{where} = {err.value}: expected {toml.INT64_WORDS}") from None
    except RecursionError as err:  # the cap on nested arrays and inline tables
        raise ConfigError(f"--set {show(key)}: {err}; expected a TOML value") from None
    return key.split("."), value


@functools.lru_cache(maxsize=4096)  # a layout search parses the same overrides thousands of times
def _override_value(raw: str) -> Any:
    try:
        return toml.loads(f"v = {raw}")["v"]
    except toml.TOMLDecodeError:
        return raw


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _suggest(word: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    leaf = word.rpartition(".")[2]
    same_leaf = [c for c in candidates if c.rpartition(".")[2] == leaf]
    close = same_leaf or difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _all_keys(sections: Sequence[ConfigSection]) -> list[str]:
    keys = ["preset"]
    for section in sections:
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(section.schema)]
    return keys


def _unknown(key: str, value: Any, sections: Sequence[ConfigSection]) -> ConfigError:
    return ConfigError(f"{key} = {show(value)}: unknown key{_suggest(key, _all_keys(sections))}")


def _apply_override(
    raw: dict[str, Any], path: list[str], value: Any, sections: Sequence[ConfigSection]
) -> None:
    key = ".".join(path)
    tables = {s.name: s for s in sections}
    if path == ["preset"]:
        raw["preset"] = value
        return
    if len(path) != 2 or path[0] not in tables:
        raise _unknown(key, value, sections)
    table = raw.setdefault(path[0], {})
    if not isinstance(table, dict):
        raise fail(path[0], table, "a table")
    table[path[1]] = value


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    """A table's field types, resolved once (a search resolves thousands of configs)."""
    return typing.get_type_hints(schema)


def _build_section(section: ConfigSection, table: Any, sections: Sequence[ConfigSection]) -> Any:
    if not isinstance(table, dict):
        raise fail(section.name, table, "a table")
    fields = {f.name: f for f in dataclasses.fields(section.schema)}
    hints = _type_hints(section.schema)
    for name, value in table.items():
        if name not in fields:
            raise _unknown(f"{section.name}.{name}", value, sections)
    values = {}
    for name, field in fields.items():
        key = f"{section.name}.{name}"
        if name in table:
            values[name] = coerce(key, hints[name], field, table[name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key} is missing: expected {describe(hints[name], field)}")
    return section.schema(**values)


def build_config(
    raw: dict[str, Any],
    sections: Sequence[ConfigSection] = CORE_SECTIONS,
    builtin_owners: Iterable[str] = (CORE_OWNER,),
    cross_field_rules: bool = True,
) -> EuropaConfig:
    """Type and check a merged raw mapping (preset already applied); without
    ``cross_field_rules``, each key is checked alone (``europa plan --search`` starts from
    a config whose layout keys it is about to replace)."""
    tables = {s.name: s for s in sections}
    for name in raw:
        if name != "preset" and name not in tables:
            if not isinstance(raw[name], dict):  # a top-level key, not a table
                raise _unknown(name, raw[name], sections)
            hint = _suggest(name, tables) or "; expected one of " + ", ".join(tables)
            raise ConfigError(f"[{name}]: unknown table{hint}")
    built = {s.name: _build_section(s, raw.get(s.name, {}), sections) for s in sections}
    core_names = {s.name for s in CORE_SECTIONS}
    # Tables of installed but not enabled plugins are checked, not kept: written back
    # by config_to_toml they would read as "set for a plugin that is not enabled".
    active = set(builtin_owners) | set(built["plugins"].enabled)
    config = EuropaConfig(
        preset=raw.get("preset", DEFAULT_PRESET),
        **{name: built[name] for name in core_names},
        extensions={
            s.name: built[s.name]
            for s in sections
            if s.name not in core_names and s.owner in active
        },
    )
    _check_plugin_tables(config, raw, sections, set(builtin_owners))
    if cross_field_rules:
        check_cross_field_rules(config)
    return config


def _check_plugin_tables(
    config: EuropaConfig,
    raw: dict[str, Any],
    sections: Sequence[ConfigSection],
    builtin_owners: set[str],
) -> None:
    """A table set for a plugin that is not switched on would be silently ignored."""
    enabled = set(config.plugins.enabled)
    for section in sections:
        if section.owner in builtin_owners or section.owner in enabled:
            continue
        if raw.get(section.name):
            raise ConfigError(
                f"[{section.name}] is set but plugin {show(section.owner)} is not enabled: "
                f"expected {section.owner} in plugins.enabled (or -p {section.owner})"
            )


def resolve_raw(
    source: str | Path | None,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    sections: Sequence[ConfigSection] = CORE_SECTIONS,
) -> dict[str, Any]:
    """Preset ← file ← ``--set`` overrides ← ``-p`` plugins, still untyped."""
    if source is None:
        file_raw: dict[str, Any] = {}
    elif str(source) in _preset_names() and not Path(source).is_file():
        file_raw = {"preset": str(source)}
    else:
        file_raw = read_toml_file(source)
    for text in overrides:
        path, value = parse_override(text)
        _apply_override(file_raw, path, value, sections)
    preset = file_raw.get("preset", DEFAULT_PRESET)
    if not isinstance(preset, str):
        raise fail("preset", preset, "a string")
    raw = _merge(_read_preset(preset), file_raw)
    raw["preset"] = preset
    if plugins:
        table = raw.setdefault("plugins", {})
        enabled = list(table.get("enabled", []))
        table["enabled"] = enabled + [p for p in plugins if p not in enabled]
    return raw


def load_config(
    source: str | Path | None = None,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    sections: Sequence[ConfigSection] = CORE_SECTIONS,
    builtin_owners: Iterable[str] = (CORE_OWNER,),
    cross_field_rules: bool = True,
) -> EuropaConfig:
    raw = resolve_raw(source, overrides, plugins, sections)
    return build_config(raw, sections, builtin_owners, cross_field_rules)


def config_to_dict(config: EuropaConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": config.preset}
    for field in dataclasses.fields(config):
        if field.name in ("preset", "extensions"):
            continue
        out[field.name] = dataclasses.asdict(getattr(config, field.name))
    for name, table in config.extensions.items():
        out[name] = dataclasses.asdict(table)
    return out


def config_to_toml(config: EuropaConfig) -> str:
    return tomli_w.dumps(config_to_dict(config))
