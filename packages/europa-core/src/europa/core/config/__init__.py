"""TOML config: presets, files and ``--set`` overrides into typed, checked tables."""

from europa.core.config.fields import ConfigSection, setting
from europa.core.config.loader import (
    DEFAULT_PRESET,
    build_config,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_override,
    preset_names,
    resolve_raw,
)
from europa.core.config.schema import CORE_SECTIONS, EuropaConfig

__all__ = [
    "CORE_SECTIONS",
    "DEFAULT_PRESET",
    "ConfigSection",
    "EuropaConfig",
    "build_config",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
    "preset_names",
    "resolve_raw",
    "setting",
]
