"""Command line: `gpuwatchd run | record | config | xid | check | clear | hang | diag | evidence`,
one module each."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from gpuwatchd import __version__, logs
from gpuwatchd.errors import ConfigError

__all__ = ["STATE_DIR_ENV", "add_state_dir", "main"]

# Every subcommand that reads or writes the store takes its directory from --state-dir,
# else from this variable, else from daemon.state_dir (scripts/run exports it).
STATE_DIR_ENV = "GPUWATCHD_STATE_DIR"

# Modules that add a subcommand through `register(subparsers)`; a module is named
# after its subcommand, so a command line loads only the module it runs.
COMMANDS: tuple[str, ...] = (
    "gpuwatchd.cli.run",
    "gpuwatchd.cli.config",
    "gpuwatchd.cli.record",
    "gpuwatchd.cli.xid",
    "gpuwatchd.cli.check",
    "gpuwatchd.cli.clear",
    "gpuwatchd.cli.hang",
    "gpuwatchd.cli.diag",
    "gpuwatchd.cli.evidence",
)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the subcommand, map errors to exit codes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_wanted(argv))
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    logs.setup(getattr(args, "log_level", None) or "info")
    try:
        rc: int = args.func(args)
        return rc
    except ConfigError as exc:
        from gpuwatchd.config.overrides import flag_error

        for line in str(flag_error(exc, args)).splitlines():  # one line per problem
            print(f"gpuwatchd: {line}", file=sys.stderr)
        return 78
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        logging.getLogger("gpuwatchd").error(
            "%s: %s (use --debug for a traceback)", type(exc).__name__, exc
        )
        return 1


def add_state_dir(parser: argparse.ArgumentParser, help: str, after: bool = False) -> None:
    """Add `--state-dir`: default $GPUWATCHD_STATE_DIR, else the config's daemon.state_dir.

    The one place the flag and the variable meet; `config.overrides.apply_overrides`
    puts the answer over daemon.state_dir. `after`: the parser is an action under a
    command that has the flag already (the command's value stays unless given again).
    """
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        default=argparse.SUPPRESS if after else os.environ.get(STATE_DIR_ENV) or None,
        help=f"{help} (default: ${STATE_DIR_ENV}, else daemon.state_dir)",
    )


def _wanted(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if it is a known one."""
    words = [a for a in argv if not a.startswith("-")]
    known = {name.rpartition(".")[2] for name in COMMANDS}
    return words[0] if words and words[0] in known else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or one with only the subcommand `only` (so `run` loads no other)."""
    parser = argparse.ArgumentParser(prog="gpuwatchd", description="Node-level GPU health daemon.")
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(metavar="COMMAND")

    for name in COMMANDS:
        if only is None or name.rpartition(".")[2] == only:
            importlib.import_module(name).register(sub)
    return parser
