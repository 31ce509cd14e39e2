"""What the command line and the environment add to the config file, for every command.

`run`, `check`, `clear` and `hang show` take the same flags for the same keys;
`load_with` reads the file and applies them in one place, and `node_name` is
the one answer to "which node is this" for the daemon and the CLI alike.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from gpuwatchd.config.load import load
from gpuwatchd.config.schema import Config
from gpuwatchd.config.validate import ConfigErrors
from gpuwatchd.errors import ConfigError

__all__ = [
    "NO_OVERRIDES",
    "OVERRIDE_FLAGS",
    "Overrides",
    "apply_overrides",
    "flag_error",
    "load_with",
    "node_name",
]


@dataclasses.dataclass(frozen=True)
class Overrides:
    """Command-line flags that take precedence over the config file."""

    listen: str | None = None
    nvml_replay: str | None = None
    state_dir: str | None = None
    log_level: str | None = None

    @classmethod
    def of(cls, args: object) -> Overrides:
        """The overrides among a subcommand's parsed arguments (a flag it lacks or left
        empty: None)."""
        return cls(**{f.name: getattr(args, f.name, None) or None for f in dataclasses.fields(cls)})


NO_OVERRIDES = Overrides()

# config key -> the Overrides field and the flag that sets it
OVERRIDE_FLAGS = {
    "http.listen": ("listen", "--listen"),
    "sources.nvml.replay": ("nvml_replay", "--nvml-replay"),
    "daemon.state_dir": ("state_dir", "--state-dir"),
    "daemon.log_level": ("log_level", "--log-level"),
}


def apply_overrides(cfg: Config, ov: Overrides) -> Config:
    """The config with every flag that was given in place of its key."""
    r = dataclasses.replace
    if ov.listen is not None:
        cfg = r(cfg, http=r(cfg.http, listen=ov.listen))
    if ov.nvml_replay is not None:
        cfg = r(cfg, sources=r(cfg.sources, nvml=r(cfg.sources.nvml, replay=ov.nvml_replay)))
    if ov.state_dir is not None:
        cfg = r(cfg, daemon=r(cfg.daemon, state_dir=ov.state_dir))
    if ov.log_level is not None:
        cfg = r(cfg, daemon=r(cfg.daemon, log_level=ov.log_level))
    return cfg


def load_with(path: str | None, ov: Overrides) -> Config:
    """The validated config file (None: the defaults) with the command line's overrides."""
    return apply_overrides(load(path), ov)


def flag_error(exc: ConfigError, ov: object) -> ConfigError:
    """The error named after the command-line flag when a flag set the bad value.

    `ov` is the Overrides, or the parsed arguments of any subcommand with such flags.
    """
    if isinstance(exc, ConfigErrors):
        return ConfigErrors([flag_error(e, ov) for e in exc.errors])
    field, flag = OVERRIDE_FLAGS.get(getattr(exc, "key", ""), ("", ""))
    if field and getattr(ov, field, None) is not None:
        return ConfigError("command line", flag, exc.problem)
    return exc


def node_name(cfg: Config) -> str:
    """The node label: config, else $GPUWATCHD_NODE_NAME (the chart sets it), else hostname."""
    return cfg.daemon.node_name or os.environ.get("GPUWATCHD_NODE_NAME") or socket.gethostname()
