"""What every subcommand shares: its parser's usage exit statuses, `--state-dir`,
argument types, and the dispatch into the one command context. Kept apart from
`cli/__init__` (which imports every subcommand) so that no subcommand imports the
package that imports it."""

from __future__ import annotations

import argparse
import math
import os
import sys
import typing

__all__ = [
    "EX_USAGE",
    "PLUGIN_USAGE",
    "Parser",
    "STATE_DIR_ENV",
    "add_state_dir",
    "command_of",
    "dispatch",
    "plugin_command",
    "seconds",
]

EX_USAGE = 64  # sysexits.h: the command was used incorrectly
PLUGIN_USAGE = 3  # UNKNOWN: what a monitoring-plugin command exits on a usage error

# Every subcommand that reads or writes the store takes its directory from --state-dir,
# else from this variable, else from daemon.state_dir (scripts/run exports it).
STATE_DIR_ENV = "GPUWATCHD_STATE_DIR"


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
