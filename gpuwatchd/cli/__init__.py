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
import math
import os
import sys
import typing
from collections.abc import Sequence

from gpuwatchd import __version__, logs
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

EX_USAGE = 64  # sysexits.h: the command was used incorrectly
PLUGIN_USAGE = 3  # UNKNOWN: what a monitoring-plugin command exits on a usage error

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


def command_of(args: argparse.Namespace) -> str:
    """The subcommand the parsed arguments run: the module its handler lives in."""
    func = getattr(args, "func", None)
    return str(getattr(func, "__module__", "")).rpartition(".")[2] or "gpuwatchd"


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed subcommand inside the one `CommandContext` (the only caller of a
    handler): config, state dir and store come from it; what the command did is
    recorded when it ends."""
    from gpuwatchd.app import CommandContext

    with CommandContext(args, command_of(args)) as ctx:
        rc: int = args.func(ctx)
    return rc


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors exit `usage_exit` (64, or 3 for a plugin command), never 2."""

    usage_exit = EX_USAGE

    def error(self, message: str) -> typing.NoReturn:
        """Print the usage and the problem, exit with this command's usage status."""
        self.print_usage(sys.stderr)
        self.exit(self.usage_exit, f"{self.prog}: error: {message}\n")


def plugin_command(parser: argparse.ArgumentParser) -> None:
    """Mark a subcommand as a monitoring plugin: usage and unexpected errors exit 3 (UNKNOWN)."""
    parser.usage_exit = PLUGIN_USAGE  # type: ignore[attr-defined]
    parser.set_defaults(plugin=True)  # for main: arguments no parser claimed, unexpected errors


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (a negative timeout is a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


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
    parser = Parser(prog="gpuwatchd", description="Node-level GPU health daemon.")
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(metavar="COMMAND")

    for name in COMMANDS:
        if only is None or name.rpartition(".")[2] == only:
            importlib.import_module(name).register(sub)
    return parser
