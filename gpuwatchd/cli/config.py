"""`gpuwatchd config check | default`: validate a file, print the defaults."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpuwatchd import config
from gpuwatchd.cli import add_state_dir
from gpuwatchd.config.overrides import Overrides

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the `config` subcommand."""
    cfg = sub.add_parser("config", help="check or print configuration")
    cfg_sub = cfg.add_subparsers(metavar="ACTION")
    check = cfg_sub.add_parser("check", help="validate a config file and exit")
    check.add_argument("file")
    add_state_dir(check, "the state dir `run` would use, checked for writing")
    check.set_defaults(func=_config_check)
    default = cfg_sub.add_parser("default", help="print the full default config")
    default.set_defaults(func=_config_default)


def _config_check(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon import load_checked  # the daemon's own checks, web config included

    load_checked(args.file, Overrides.of(args))  # every check `run` makes, all at once
    print(f"{args.file}: ok")
    return 0


def _config_default(_args: argparse.Namespace) -> int:
    sys.stdout.write(config.render_default())
    return 0
