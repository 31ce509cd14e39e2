"""`gpuwatchd run`: the daemon."""

from __future__ import annotations

import argparse
import importlib.machinery
import sys
import threading
import types
from typing import Any

from gpuwatchd.cli import add_state_dir

__all__ = ["defer_ssl", "register"]


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


class _DeferredSsl(types.ModuleType):
    """Stands in for ssl in sys.modules; its first attribute read loads the real one."""

    def __getattr__(self, attr: str) -> Any:
        with _LOADING:
            if sys.modules.get("ssl") is self:
                del sys.modules["ssl"]
                import ssl

                self.__dict__.update(ssl.__dict__)
        return getattr(sys.modules["ssl"], attr)


_LOADING = threading.Lock()


def defer_ssl() -> None:
    """Load ssl at its first use instead of when a module merely imports it.

    ssl brings libssl and libcrypto (about 5 MiB resident), and the web config
    and the Alertmanager client import it though a daemon without TLS never
    uses it; `import ssl` alone reads nothing from the module.
    """
    if "ssl" in sys.modules:
        return
    stub = _DeferredSsl("ssl")
    stub.__spec__ = importlib.machinery.ModuleSpec("ssl", None)
    sys.modules["ssl"] = stub


def _run(args: argparse.Namespace) -> int:
    defer_ssl()
    from gpuwatchd.daemon import Daemon, Overrides

    overrides = Overrides(
        listen=args.listen,
        nvml_replay=args.nvml_replay,
        state_dir=args.state_dir,
        log_level=args.log_level,
    )
    return Daemon(args.config, overrides).run()
