"""Logging: one plain line per record on stderr, or structured journal entries."""

from __future__ import annotations

import logging
import os
import re
import sys
import time

__all__ = ["escape_control", "redact", "setup"]

_FMT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# C0 and C1 controls and DEL; a newline in a process name must not start a forged log line.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
# user:password@ in a URL; config refuses them, this is the second line of defence.
_URL_USERINFO = re.compile(r"(\w{1,16}://)[^/@\s]{1,256}@")


def escape_control(text: str, limit: int | None = None) -> str:
    """`text` with control characters written as escapes, cut to `limit` characters."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    return text.translate(_CONTROL)


def redact(text: str) -> str:
    """`text` with URL credentials replaced by `<redacted>`."""
    return _URL_USERINFO.sub(r"\1<redacted>@", text) if "@" in text else text


class _SafeMessage(logging.Filter):
    """Escape control characters and redact URL credentials in every log message."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as usual
            return True
        record.msg, record.args = escape_control(redact(message), 16384), None
        return True


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
    handler.addFilter(_SafeMessage())
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
