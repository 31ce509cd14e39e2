"""Connection deadlines: one live entry per connection, none kept for a closed one."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from gpuwatchd.http.timers import Deadlines


class Conn:
    def __init__(self) -> None:
        self.timer: list[Any] | None = None


def test_earliest_first_and_a_moved_deadline_replaces_the_old() -> None:
    d = Deadlines()
    a, b = Conn(), Conn()
    d.set(a, 5.0)
    d.set(b, 3.0)
    d.set(b, 7.0)  # moved: the entry at 3.0 no longer counts
    assert d.next_due() == 5.0
    assert d.pop_due(4.0) is None
    assert d.pop_due(6.0) is a and a.timer is None
    assert d.pop_due(6.0) is None and d.pop_due(7.0) is b
    assert d.next_due() is None


def test_one_early_deadline_keeps_nothing_of_closed_connections_alive() -> None:
    d = Deadlines()
    idle = Conn()
    d.set(idle, 1.0)  # the earliest deadline, for the whole flood
    gone: list[weakref.ref[Conn]] = []
    for i in range(10_000):
        c = Conn()
        d.set(c, 10.0 + i)  # a request head
        d.set(c, 20.0 + i)  # its response
        d.set(c, 11.0 + i)  # its linger
        d.cancel(c)  # closed
        gone.append(weakref.ref(c))
    del c
    gc.collect()
    assert not any(ref() is not None for ref in gone)
    assert len(d) <= 2 * 1 + 64 + 1  # rebuilt once invalidated entries outnumber live ones
    assert d.pop_due(2.0) is idle and d.next_due() is None
