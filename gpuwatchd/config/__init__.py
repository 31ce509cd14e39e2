"""Configuration: YAML -> frozen dataclasses, fully validated at start.

Every key has a default, so the daemon runs with no file at all. Each
field's `metadata["help"]` is the one-line why that `config default`
prints; `metadata["min"]`/`["max"]` bound numbers; `metadata["choices"]`
bounds strings. Validation errors name the file, the key path and the
problem (see errors.ConfigError). `schema` holds the sections, `load` the
reading and checking.
"""

from __future__ import annotations

from gpuwatchd.config.load import load, load_text, read, render_default
from gpuwatchd.config.schema import (
    DEFAULT_PORT,
    AlertmanagerConfig,
    Config,
    DaemonConfig,
    HealthConfig,
    HttpConfig,
    InfinibandConfig,
    KmsgConfig,
    MemoryConfig,
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
from gpuwatchd.config.validate import (
    ConfigErrors,
    check_paths,
    check_state_dir,
    raise_all,
    validate,
    validate_listen,
)

__all__ = [
    "AlertmanagerConfig",
    "Config",
    "ConfigErrors",
    "DEFAULT_PORT",
    "DaemonConfig",
    "HealthConfig",
    "HttpConfig",
    "InfinibandConfig",
    "KmsgConfig",
    "MemoryConfig",
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
    "check_state_dir",
    "load",
    "load_text",
    "raise_all",
    "read",
    "render_default",
    "validate",
    "validate_listen",
]
