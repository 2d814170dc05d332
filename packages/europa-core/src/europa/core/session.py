"""Config and plugins resolved together: which tables exist depends on the
installed plugins, and which plugins run depends on the config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from europa.core.config import EuropaConfig, load_config
from europa.core.plugins.manager import EuropaPluginManager
from europa.core.run_dir import CONFIG_FILE


def open_session(
    source: str | Path | None = None,
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    manager: EuropaPluginManager | None = None,
    cross_field_rules: bool = True,
) -> tuple[EuropaConfig, EuropaPluginManager]:
    """Load plugins, resolve the config against every declared table, switch on
    the plugins the config names (``cross_field_rules``: see ``build_config``)."""
    manager = manager or EuropaPluginManager()
    config = load_config(
        source,
        overrides,
        plugins,
        sections=manager.config_sections(),
        cross_field_rules=cross_field_rules,
    )
    manager.enable(config.plugins.enabled)
    return config, manager


def load_run_config(
    run_dir: Path, overrides: Sequence[str] = ()
) -> tuple[EuropaConfig, EuropaPluginManager]:
    """The resolved config a run directory was started with."""
    return open_session(run_dir / CONFIG_FILE, overrides)
