"""A small sd_notify client: READY, RELOADING, STOPPING, STATUS, WATCHDOG.

Uses systemd-python's `systemd.daemon.notify` when it is installed and
falls back to writing the datagram itself. Every call is a no-op without
NOTIFY_SOCKET, so the daemon behaves the same outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

__all__ = ["Notifier"]

log = logging.getLogger("gpuwatchd.systemd")


def _library_notify() -> Callable[[str], bool] | None:
    try:
        from systemd import daemon  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    fn: Callable[[str], bool] = daemon.notify
    return fn


class Notifier:
    """Sends sd_notify messages to $NOTIFY_SOCKET, if any."""

    def __init__(self, env: Mapping[str, str] | None = None, use_library: bool = True) -> None:
        env = os.environ if env is None else env
        self._address = env.get("NOTIFY_SOCKET", "")
        # Load the bindings (and libsystemd) only when there is someone to notify.
        wanted = use_library and env is os.environ and bool(self._address)
        self._library = _library_notify() if wanted else None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self._watchdog_usec = int(usec) if usec.isdigit() else 0
        if pid.isdigit() and int(pid) != os.getpid():
            self._watchdog_usec = 0  # the watchdog is meant for another process

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the configured timeout), or None."""
        return self._watchdog_usec / 2e6 if self._watchdog_usec else None

    def notify(self, message: str) -> bool:
        if not self._address:
            return False
        if self._library is not None:
            try:
                return bool(self._library(message))
            except OSError as exc:
                log.debug("systemd.daemon.notify failed: %s", exc)
        return self._send(message)

    def _send(self, message: str) -> bool:
        addr = self._address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), addr)
            return True
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address, exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")
