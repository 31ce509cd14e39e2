"""`gpuwatchd config check | default`: validate a file, print the defaults."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from gpuwatchd import config
from gpuwatchd.cli.command import add_state_dir

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

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


def _config_check(ctx: CommandContext) -> int:
    from gpuwatchd.daemon import load_checked  # the daemon's own checks, web config included

    path = str(ctx.args.file)
    load_checked(path, ctx.overrides)  # every check `run` makes, all at once
    print(f"{path}: ok")
    return 0


def _config_default(_ctx: CommandContext) -> int:
    sys.stdout.write(config.render_default())
    return 0
