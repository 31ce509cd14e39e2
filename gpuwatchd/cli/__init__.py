"""Command line: `gpuwatchd run | record | config | xid | check | clear | hang | diag | evidence`,
one module each.

Every subcommand runs inside one `app.CommandContext` that `main` enters and
hands to it (`func(ctx)`): the config with overrides, the state dir, the
store, and what the command did recorded on exit.

Exit status 2 means CRITICAL to every monitoring-plugin caller, so no usage
error exits 2: a usage error is 3 (UNKNOWN) for the plugin-style commands
(`check`, `diag`) and 64 (EX_USAGE) for the rest; a bad config is 78; an
unexpected error is 3 from a plugin command (1 would read as WARNING), else 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from gpuwatchd import __version__, logs
from gpuwatchd.cli.command import (
    EX_USAGE,
    PLUGIN_USAGE,
    STATE_DIR_ENV,
    Parser,
    add_state_dir,
    command_of,
    dispatch,
    plugin_command,
    seconds,
)
from gpuwatchd.errors import ConfigError

__all__ = [
    "EX_USAGE",
    "PLUGIN_USAGE",
    "Parser",
    "STATE_DIR_ENV",
    "add_state_dir",
    "command_of",
    "dispatch",
    "main",
    "plugin_command",
    "seconds",
]

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
    args, extra = parser.parse_known_args(argv)
    if extra:  # found after the subcommand parsed: exit with the subcommand's usage status
        print(f"gpuwatchd: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return PLUGIN_USAGE if getattr(args, "plugin", False) else EX_USAGE
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EX_USAGE
    logs.setup(getattr(args, "log_level", None) or "info")
    try:
        return dispatch(args)
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
        return PLUGIN_USAGE if getattr(args, "plugin", False) else 1  # never WARNING from a bug


def _wanted(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if it is a known one."""
    words = [a for a in argv if not a.startswith("-")]
    known = {name.rpartition(".")[2] for name in COMMANDS}
    return words[0] if words and words[0] in known else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or one with only the subcommand `only` (so `run` loads no other)."""
    parser = Parser(prog="gpuwatchd", description="Node-level GPU health daemon.")
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(metavar="COMMAND")

    for name in COMMANDS:
        if only is None or name.rpartition(".")[2] == only:
            importlib.import_module(name).register(sub)
    return parser
