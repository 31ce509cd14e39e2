"""A small sd_notify client: READY, RELOADING, STOPPING, STATUS, WATCHDOG.

Writes the datagram itself, never blocking: a receiver that does not read
(a busy PID 1, a test harness) fills the socket's queue, and then
systemd-python's `systemd.daemon.notify` blocked in sd_notify while holding
the GIL, which froze every thread of the daemon (scrapes, sources, the
consumer) for 90 s and more in a replay soak. A message that finds the queue
full is dropped and counted (the next WATCHDOG=1 comes a few seconds later);
READY=1 and STOPPING=1 get a few short retries first. Every call is a no-op
without NOTIFY_SOCKET, so the daemon behaves the same outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger("gpuwatchd.systemd")


_RETRIES = 10  # READY=1 / STOPPING=1 on a full queue: up to 10 tries 50 ms apart
_RETRY_WAIT = 0.05


class Notifier:
    """Sends sd_notify messages to $NOTIFY_SOCKET, if any."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._address = env.get("NOTIFY_SOCKET", "")
        self.dropped = 0  # messages dropped because the receiver's queue was full
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

    def notify(self, message: str, retries: int = 0) -> bool:
        if not self._address:
            return False
        addr = self._address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        data = message.encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                for attempt in range(retries + 1):
                    try:
                        sock.sendto(data, socket.MSG_DONTWAIT, addr)
                        return True
                    except BlockingIOError:
                        if attempt < retries:
                            time.sleep(_RETRY_WAIT)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address, exc)
            return False
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 100 == 0:
            log.warning(
                "sd_notify to %s: the receiver's queue is full; %d message(s) dropped so far",
                self._address,
                self.dropped,
            )
        return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""), _RETRIES)

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", _RETRIES)

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")
