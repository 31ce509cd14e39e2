"""Configuration: YAML -> frozen dataclasses, fully validated at start.

Every key has a default, so the daemon runs with no file at all. Each
field's `metadata["help"]` is the one-line why that `config default`
prints; `metadata["min"]`/`["max"]` bound numbers; `metadata["choices"]`
bounds strings. Validation errors name the file, the key path and the
problem (see errors.ConfigError). `schema` holds the sections, `load` the
reading and checking.
"""

from __future__ import annotations

from gpuwatchd.config.load import check_paths, load, load_text, render_default, validate_listen
from gpuwatchd.config.schema import (
    DEFAULT_PORT,
    AlertmanagerConfig,
    Config,
    DaemonConfig,
    HealthConfig,
    HttpConfig,
    InfinibandConfig,
    KmsgConfig,
    NvmlConfig,
    PathsConfig,
    ShmConfig,
    SourcesConfig,
    StoreConfig,
    StuckConfig,
    UdevConfig,
    XidConfig,
    XidRule,
)

__all__ = [
    "AlertmanagerConfig",
    "Config",
    "DEFAULT_PORT",
    "DaemonConfig",
    "HealthConfig",
    "HttpConfig",
    "InfinibandConfig",
    "KmsgConfig",
    "NvmlConfig",
    "PathsConfig",
    "ShmConfig",
    "SourcesConfig",
    "StoreConfig",
    "StuckConfig",
    "UdevConfig",
    "XidConfig",
    "XidRule",
    "check_paths",
    "load",
    "load_text",
    "render_default",
    "validate_listen",
]
