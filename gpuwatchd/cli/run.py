"""`gpuwatchd run`: the daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.command import add_state_dir

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

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


def _run(ctx: CommandContext) -> int:
    from gpuwatchd.daemon import Daemon

    # The daemon reads the file itself (at start and on SIGHUP), with the context's overrides.
    return Daemon(ctx.config_path, ctx.overrides).run()
