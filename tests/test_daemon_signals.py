"""The main loop's signal queue: a stop wins over pending reloads, which collapse into one."""

from __future__ import annotations

import signal

from gpuwatchd.daemon import Daemon


def test_a_stop_is_never_queued_behind_reloads() -> None:
    d = Daemon(None)
    for _ in range(50):
        d.signals.put(signal.SIGHUP)
    d.signals.put(signal.SIGINT)
    assert d._next_signal(d.signals.get()) == signal.SIGINT
    assert d.signals.empty()


def test_pending_reloads_are_one() -> None:
    d = Daemon(None)
    for _ in range(50):
        d.signals.put(signal.SIGHUP)
    assert d._next_signal(d.signals.get()) == signal.SIGHUP
    assert d.signals.empty()
    d.signals.put(signal.SIGTERM)
    d.signals.put(signal.SIGHUP)
    assert d._next_signal(d.signals.get()) == signal.SIGTERM
