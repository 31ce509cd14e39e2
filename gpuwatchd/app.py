"""The app layer: what every command enters, and the parts a mode is assembled from.

`CommandContext` is the one context every subcommand runs in (`cli.main`
enters it and hands it to the command): the config with the command line's
overrides, read once; the state dir (`--state-dir`, then
$GPUWATCHD_STATE_DIR, then daemon.state_dir); the event store, opened when
the command asks for it; and what the command did, recorded in that store
when the command ends, whatever way it ends. A command does not write its
outcome itself: it hands it to `ctx.done`, so a CLI diag run lands in the
daemon's store (trigger `cli`) like a scheduled one.

`assemble` builds the consumer chain for a mode: the daemon's `Pipeline`
(consumer thread, store, sinks, hang monitor) or the one-shot chain `check`
runs over the daemon's store read-only.

This module is imported by every command line, so it loads nothing heavy
until a command asks for it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from gpuwatchd.config.overrides import Overrides

if TYPE_CHECKING:
    from gpuwatchd.clock import Clock
    from gpuwatchd.config import Config
    from gpuwatchd.pipeline import Consumers, StoreReader
    from gpuwatchd.pipeline.daemon import Pipeline
    from gpuwatchd.sinks.store import EventStore
    from gpuwatchd.state import State

__all__ = [
    "CLI_TRIGGER",
    "CommandContext",
    "Mode",
    "Outcome",
    "RETIRED_HANG_OUTBOX",
    "assemble",
    "retire_hang_outbox",
]

log = logging.getLogger("gpuwatchd")

CLI_TRIGGER = "cli"  # how a command's recorded outcome says who made it
# Earlier versions kept job-hang alerts in an outbox of their own: retired at start.
RETIRED_HANG_OUTBOX = "hang-alerts.db"


class Outcome(Protocol):
    """What a command did, as it goes into the event store (a diag run, say)."""

    def record_into(self, store: EventStore, trigger: str) -> None: ...


class Mode(enum.Enum):
    """What the parts are assembled for."""

    DAEMON = "daemon"  # long-lived: consumer thread, store written, alert and other sinks
    CHECK = "check"  # one-shot: the same chain in the caller's thread, the store read-only


class CommandContext:
    """The one context every subcommand enters (see the module docstring)."""

    def __init__(self, args: Any, command: str) -> None:
        self.args: Any = args  # the parsed command line (an argparse.Namespace)
        self.command = command
        self.overrides = Overrides.of(args)
        self.config_path: str | None = getattr(args, "config", None) or None
        self._config: Config | None = None
        self._store: EventStore | None = None
        self._outcomes: list[Outcome] = []
        self.entered = False

    def __enter__(self) -> CommandContext:
        self.entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._record()
        finally:
            if self._store is not None:
                self._store.close()
                self._store = None

    # --- what the command reads ---------------------------------------------------------

    @property
    def config(self) -> Config:
        """The config file (or the defaults) with the command line's overrides, read once."""
        if self._config is None:
            from gpuwatchd.config.overrides import load_with

            self._config = load_with(self.config_path, self.overrides)
        return self._config

    @property
    def state_dir(self) -> str:
        """--state-dir, else $GPUWATCHD_STATE_DIR (the flag's default), else the config's."""
        return self.config.daemon.state_dir

    def has_store(self) -> bool:
        """Whether the daemon's event store exists under the state dir."""
        from gpuwatchd.sinks.store import DB_NAME

        return os.path.exists(os.path.join(self.state_dir, DB_NAME))

    def store(self) -> EventStore:
        """The event store under the state dir, opened at the first call, closed on exit."""
        if self._store is None:
            from gpuwatchd.sinks.store import EventStore

            self._store = EventStore.from_config(self.config)
        return self._store

    # --- what the command did -----------------------------------------------------------

    def done(self, outcome: Outcome) -> None:
        """Record `outcome` in the store when the command ends (trigger `cli`)."""
        self._outcomes.append(outcome)

    def _record(self) -> None:
        if not self._outcomes:
            return
        outcomes, self._outcomes = self._outcomes, []
        why = self._unwritable()
        if why:
            print(f"gpuwatchd {self.command}: not recorded: {why}", file=sys.stderr)
            return
        from gpuwatchd.errors import GpuwatchdError

        try:
            store = self.store()
            for outcome in outcomes:
                outcome.record_into(store, CLI_TRIGGER)
        except (GpuwatchdError, OSError) as exc:  # never changes what the command reports
            print(f"gpuwatchd {self.command}: not recorded: {exc}", file=sys.stderr)

    def _unwritable(self) -> str:
        """Why the state dir cannot take a record (no such dir, no write access), or ""."""
        path = self.state_dir
        if not os.path.isdir(path):
            return f"no state dir {path} (pass the daemon's --state-dir or set GPUWATCHD_STATE_DIR)"
        if not self.has_store() and not os.access(path, os.W_OK):
            return f"cannot write to {path}"
        return ""


@overload
def assemble(
    mode: Literal[Mode.DAEMON],
    cfg: Config,
    state: State,
    clock: Clock,
    *,
    node: str = ...,
    listen_port: int = ...,
    source_names: Iterable[str] = ...,
    store: StoreReader | None = ...,
) -> Pipeline: ...


@overload
def assemble(
    mode: Literal[Mode.CHECK],
    cfg: Config,
    state: State,
    clock: Clock,
    *,
    node: str = ...,
    listen_port: int = ...,
    source_names: Iterable[str] = ...,
    store: StoreReader | None = ...,
) -> Consumers: ...


def assemble(
    mode: Mode,
    cfg: Config,
    state: State,
    clock: Clock,
    *,
    node: str = "",
    listen_port: int = 0,
    source_names: Iterable[str] = (),
    store: StoreReader | None = None,
) -> Consumers:
    """The consumer chain for `mode` (the daemon's is a `Pipeline`)."""
    if mode is Mode.DAEMON:
        from gpuwatchd.pipeline.daemon import Pipeline  # the sinks and HTTP: the daemon's only

        retire_hang_outbox(cfg.daemon.state_dir)
        return Pipeline(cfg, state, clock, node, listen_port, source_names)
    from gpuwatchd.pipeline import Consumers, one_shot_config

    return Consumers(one_shot_config(cfg), state, clock, store, source_names, one_shot=True)


def retire_hang_outbox(state_dir: str) -> None:
    """Remove the job-hang outbox earlier versions kept (hang alerts now go through the
    one sink). What it still held expires in Alertmanager at its endsAt, minutes away;
    the hangs still there are found again and sent through the one sink."""
    path = os.path.join(state_dir, RETIRED_HANG_OUTBOX)
    removed = []
    for name in (path, path + "-wal", path + "-shm"):
        try:
            os.unlink(name)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the retired hang alert outbox %s: %s", name, exc)
    if removed:
        log.info("removed %s: job-hang alerts now leave through the one alert outbox", path)
