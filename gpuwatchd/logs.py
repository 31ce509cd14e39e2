"""Logging: one plain line per record on stderr, or structured journal entries."""

from __future__ import annotations

import logging
import os
import sys
import time

__all__ = ["setup"]

_FMT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _UTCFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        t = time.gmtime(record.created)
        return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def setup(level: str = "info", journal: bool | None = None) -> None:
    """Configure the root logger once; call again to change the level (SIGHUP)."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if getattr(setup, "_done", False):
        return
    handler: logging.Handler | None = None
    if journal is None:
        # systemd sets JOURNAL_STREAM when stderr is connected to the journal
        journal = bool(os.environ.get("JOURNAL_STREAM"))
    if journal:
        handler = _journal_handler()
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_UTCFormatter(_FMT))
    root.handlers[:] = [handler]
    setup._done = True  # type: ignore[attr-defined]


def _journal_handler() -> logging.Handler | None:
    try:
        from systemd.journal import JournalHandler  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    # Extra fields passed with `extra={"GPU_UUID": ..., "XID": ...}` become journal fields.
    handler: logging.Handler = JournalHandler(SYSLOG_IDENTIFIER="gpuwatchd")
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    return handler
