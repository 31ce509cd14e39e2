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


def test_a_thread_death_wins_over_every_signal() -> None:
    from gpuwatchd.daemon import THREAD_DIED

    d = Daemon(None)
    for signum in (signal.SIGHUP, signal.SIGTERM, THREAD_DIED, signal.SIGINT):
        d.signals.put(signum)
    assert d._next_signal(d.signals.get()) == THREAD_DIED
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


def test_a_stop_ends_the_wait_of_a_reload() -> None:
    from gpuwatchd.clock import FakeClock

    clock = FakeClock()
    d = Daemon(None, clock=clock)
    calls = []

    def never_done() -> bool:
        calls.append(1)
        if len(calls) == 3:
            d.signals.put(signal.SIGHUP)
            d.signals.put(signal.SIGTERM)
        clock.advance(0.1)
        return False

    d._wait_unless_stopped(never_done, 60.0)
    assert len(calls) == 3  # not 600: the stop ended the wait
    assert d._next_signal(d.signals.get_nowait()) == signal.SIGTERM
