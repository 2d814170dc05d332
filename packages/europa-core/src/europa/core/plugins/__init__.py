"""The plugin registry: built-in defaults plus the ``europa`` entry-point group."""

from europa.core.plugins.manager import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    EuropaPluginManager,
    PluginInfo,
)

__all__ = ["DISABLE_ENV", "ENTRY_POINT_GROUP", "EuropaPluginManager", "PluginInfo"]
