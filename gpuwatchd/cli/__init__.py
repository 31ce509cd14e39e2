"""Command line: `gpuwatchd run | record | config | xid | check | clear`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from gpuwatchd import __version__, config, logs
from gpuwatchd.errors import ConfigError

__all__ = ["main"]

# Modules that add a subcommand through `register(subparsers)`.
COMMANDS: tuple[str, ...] = (
    "gpuwatchd.sources.nvml.record",
    "gpuwatchd.cli.xid",
    "gpuwatchd.cli.check",
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

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults)")
    run.add_argument("--listen", metavar="HOST:PORT", help="override http.listen")
    run.add_argument("--nvml-replay", metavar="FILE", help="replay a recorded NVML capture")
    run.add_argument("--state-dir", metavar="DIR", help="override daemon.state_dir")
    run.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="override log level"
    )
    run.set_defaults(func=_run)

    cfg = sub.add_parser("config", help="check or print configuration")
    cfg_sub = cfg.add_subparsers(metavar="ACTION")
    check = cfg_sub.add_parser("check", help="validate a config file and exit")
    check.add_argument("file")
    check.set_defaults(func=_config_check)
    default = cfg_sub.add_parser("default", help="print the full default config")
    default.set_defaults(func=_config_default)

    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon import Daemon, Overrides

    overrides = Overrides(
        listen=args.listen,
        nvml_replay=args.nvml_replay,
        state_dir=args.state_dir,
        log_level=args.log_level,
    )
    return Daemon(args.config, overrides).run()


def _config_check(args: argparse.Namespace) -> int:
    cfg = config.load(args.file)
    config.check_paths(cfg, args.file)
    print(f"{args.file}: ok")
    return 0


def _config_default(_args: argparse.Namespace) -> int:
    sys.stdout.write(config.render_default())
    return 0
