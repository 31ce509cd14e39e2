"""`gpuwatchd run`: the daemon."""

from __future__ import annotations

import argparse
from typing import Any

from gpuwatchd.cli import add_state_dir

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the `run` subcommand."""
    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults)")
    run.add_argument("--listen", metavar="HOST:PORT", help="override http.listen")
    run.add_argument("--nvml-replay", metavar="FILE", help="replay a recorded NVML capture")
    add_state_dir(run, "event store and cursors")
    run.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="override log level"
    )
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon import Daemon, Overrides

    overrides = Overrides(
        listen=args.listen,
        nvml_replay=args.nvml_replay,
        state_dir=args.state_dir,
        log_level=args.log_level,
    )
    return Daemon(args.config, overrides).run()
