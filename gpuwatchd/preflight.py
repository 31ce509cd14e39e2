"""Files the config names that only a higher layer can parse, read as the daemon will read them.

`config.validate` checks what core can (readable, floors, TLS material);
the NVML replay capture and the site hang signatures are parsed here by
the code that uses them, so a file that would stop the daemon later is a
one-line error and exit 78 at `config check` and at start, never a
traceback once the sources are being built.
"""

from __future__ import annotations

import os

from gpuwatchd.config import Config, raise_all
from gpuwatchd.errors import ConfigError

__all__ = ["check_parsed_files"]


def check_parsed_files(cfg: Config, file: str) -> None:
    """Raise ConfigError(s) for a replay capture or signatures file its user would refuse."""
    errors: list[ConfigError] = []
    replay = cfg.sources.nvml.replay
    if replay and os.access(replay, os.R_OK):  # unreadable: check_paths already said so
        from gpuwatchd.sources.nvml.replay import ReplayClient

        try:
            ReplayClient.load(replay)
        except Exception as exc:  # any reason the NVML source would refuse it
            problem = f"{replay}: not a usable NVML capture: {exc}"
            errors.append(ConfigError(file, "sources.nvml.replay", problem))
    signatures = cfg.hangs.signatures_file
    if signatures and os.access(signatures, os.R_OK):
        from gpuwatchd.health.hangs.signatures import load_catalog

        try:
            load_catalog(signatures)
        except ConfigError as exc:
            errors.append(exc)
    raise_all(errors)
