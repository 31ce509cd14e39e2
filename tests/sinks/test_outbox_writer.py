"""The alert sink's outbox writes off the caller's thread: in order, none skipped, and the
caller never waits for a (slow) fsync."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

from gpuwatchd.clock import SystemClock
from gpuwatchd.config import Config
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from tests.health.snapshots import GPU0, GPU1
from tests.sinks.test_alertmanager import wait_for, xid_finding


def alerts(sink: AlertSink) -> list[dict[str, Any]]:
    return cast(list[dict[str, Any]], sink.status()["alerts"])


def test_update_never_waits_for_fsync_and_skips_no_alert_set(tmp_path: Path) -> None:
    synced: list[float] = []
    slow = threading.Event()

    def slow_fsync(fd: int) -> None:
        if slow.is_set():
            time.sleep(1.0)
        synced.append(time.monotonic())

    sink = AlertSink(Config(), str(tmp_path / "state.db"), SystemClock(), "n1", fsync=slow_fsync)
    sink.start()
    try:
        slow.set()
        a, b = xid_finding(79, GPU0), xid_finding(48, GPU1)
        start = time.monotonic()
        sink.update([a])  # fires...
        sink.update([])  # ...and resolves while the first fsync still sleeps
        sink.update([b])
        assert time.monotonic() - start < 0.5, "update() waited for the disk"

        def states() -> dict[str, str]:
            return {al["labels"]["xid"]: al["status"] for al in alerts(sink)}

        # the short-lived alert was recorded (fired, then resolved), not skipped
        assert wait_for(lambda: states() == {"79": "resolved", "48": "firing"}, 5.0), states()
        assert wait_for(lambda: len(synced) >= 1, 5.0)
    finally:
        slow.clear()
        sink.stop(flush_timeout=5.0)
    # stop() syncs what is left: a reopened outbox holds both
    again = AlertSink(Config(), str(tmp_path / "state.db"), SystemClock(), "n1")
    try:
        assert {al["labels"]["xid"] for al in alerts(again)} == {"79", "48"}
    finally:
        again.stop(flush_timeout=1.0)
