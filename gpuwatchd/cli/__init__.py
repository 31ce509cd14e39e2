"""Command line: `gpuwatchd run | record | config | xid | check | clear`, one module each."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from gpuwatchd import __version__, logs
from gpuwatchd.errors import ConfigError

__all__ = ["main"]

# Modules that add a subcommand through `register(subparsers)`.
COMMANDS: tuple[str, ...] = (
    "gpuwatchd.cli.run",
    "gpuwatchd.cli.config",
    "gpuwatchd.cli.record",
    "gpuwatchd.cli.xid",
    "gpuwatchd.cli.check",
    "gpuwatchd.cli.clear",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    logs.setup(getattr(args, "log_level", None) or "info")
    try:
        rc: int = args.func(args)
        return rc
    except ConfigError as exc:
        print(f"gpuwatchd: {exc}", file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuwatchd", description="Node-level GPU health daemon.")
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(metavar="COMMAND")

    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser
