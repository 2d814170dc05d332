"""EUROPA core: the MoE model, plugin registry, TOML config and trainer."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("europa-core")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"
