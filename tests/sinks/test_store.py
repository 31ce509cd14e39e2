"""SQLite event store: schema, atomic events+cursor, bursts, retention, clears, /events."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from gpuwatchd.errors import StoreError
from gpuwatchd.http.endpoints import events_route
from gpuwatchd.model import Event, Severity
from gpuwatchd.sinks.store import SCHEMA_VERSION, EventStore, Record

T = 1_700_000_000.0


def ev(code: int = 31, t: float = T, bus: str = "0000:00:06.0", **attrs: str) -> Event:
    base = {
        "boot_id": "boot-a",
        "sequence": "373",
        "gpu": "0",
        "uuid": "GPU-544a",
        "pid": "650",
        "process": "python3",
        "name": "GPU memory page fault",
        "action": "restart_app",
        "raw": "NVRM: Xid (PCI:0000:00:06): 31, pid=650, name=python3, ...",
        "attribution": "kubernetes",
        "pod_uid": "1f0c6e2a-3b4d-4c5e-9f60-7a8b9c0d1e2f",
    }
    base.update(attrs)
    return Event(
        "xid", "kmsg", t, code, bus, "MMU Fault", Severity.WARNING, tuple(sorted(base.items()))
    )


class Clock:
    def __init__(self) -> None:
        self.now = T

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock):
    s = EventStore(
        str(tmp_path / "state" / "gpuwatchd.db"), max_events=100, max_age_days=1, clock=clock
    )
    yield s
    s.close()


def test_schema_is_created_and_versioned(store: EventStore, tmp_path: Path) -> None:
    assert store.schema_version() == SCHEMA_VERSION
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"events", "cursors", "clears", "store_meta"} <= tables
    db.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    EventStore(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE store_meta SET value = '99' WHERE key = 'events_schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this gpuwatchd"):
        EventStore(str(path))


def test_unwritable_place_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError):
        EventStore(str(tmp_path / "file" / "sub" / "g.db"))


def test_events_and_cursor_survive_a_reopen(store: EventStore, clock: Clock) -> None:
    store.write([Record(ev(), "b1")], {"kmsg": "kmsg:boot-a:373"})
    store.close()
    again = EventStore(store.path, clock=clock)
    assert again.load_cursor("kmsg") == "kmsg:boot-a:373"
    assert again.load_cursor("nothing") is None
    (row,) = again.recent()
    assert (row["code"], row["pci_bus_id"], row["pid"], row["process"], row["sequence"]) == (
        31,
        "0000:00:06.0",
        650,
        "python3",
        373,
    )
    assert row["boot_id"] == "boot-a" and row["severity"] == "warning"
    assert row["attribution"] == {
        "attribution": "kubernetes",
        "pod_uid": "1f0c6e2a-3b4d-4c5e-9f60-7a8b9c0d1e2f",
    }
    assert row["raw"].startswith("NVRM: Xid")
    again.close()


def test_cursor_moves_only_with_its_events(store: EventStore) -> None:
    store.write([Record(ev(), "b1")], {"kmsg": "kmsg:boot-a:10"})
    # a failure in the middle of the transaction must leave the old cursor
    db = sqlite3.connect(store.path)
    db.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON events WHEN NEW.code = 666 "
        "BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
    )
    db.commit()
    db.close()
    # write() never raises: the batch and its cursor are held in memory and retried
    store.write([Record(ev(13), "b2"), Record(ev(666), "b3")], {"kmsg": "kmsg:boot-a:20"})
    assert store.load_cursor("kmsg") == "kmsg:boot-a:10"
    assert [r["code"] for r in store.recent()] == [31]
    assert store.errors["write"] == 1 and len(store.held) == 2
    assert "disk says no" in store.problem and store.state_dir in store.problem


def test_a_burst_is_one_row_with_a_count(store: EventStore) -> None:
    store.write([Record(ev(95, T), "burst-1", 1)])
    store.write([Record(ev(95, T + 5), "burst-1", 2), Record(ev(95, T + 9), "burst-1", 3)])
    (row,) = store.recent()
    assert (row["count"], row["time"], row["last_time"]) == (3, T, T + 9)
    store.write([Record(ev(95, T + 100), "burst-2", 1)])
    assert [r["count"] for r in store.recent()] == [1, 3]


def test_retention_by_count_and_age(store: EventStore, clock: Clock) -> None:
    store.write([Record(ev(13, T + i), f"b{i}") for i in range(130)])
    store.prune()
    assert store.count() == 100
    assert min(r["time"] for r in store.recent(1000)) == T + 30  # the oldest went first
    clock.now = T + 2 * 86400  # everything is older than max_age_days=1 now
    store.write([Record(ev(48, clock.now), "fresh")])
    store.prune()
    assert [r["code"] for r in store.recent(1000)] == [48]


def test_recent_filters(store: EventStore) -> None:
    store.write(
        [
            Record(ev(31, T, "0000:00:06.0"), "a"),
            Record(ev(79, T + 1, "0000:00:07.0", uuid="GPU-77", gpu="1"), "b"),
            Record(ev(79, T + 2, "0000:00:06.0"), "c"),
        ]
    )
    assert [r["code"] for r in store.recent(code=79)] == [79, 79]
    assert [r["time"] for r in store.recent(gpu="GPU-77")] == [T + 1]
    assert [r["time"] for r in store.recent(gpu="1")] == [T + 1]
    assert [r["time"] for r in store.recent(since=T + 1.5)] == [T + 2]
    assert len(store.recent(limit=1)) == 1
    assert store.recent(kind="sxid") == []


def test_events_since_gives_events_back_for_restore(store: EventStore) -> None:
    store.write([Record(ev(48, T), "b1", 4), Record(ev(79, T + 1), "b2")])
    back = store.events_since(T - 1)
    assert [(e.code, e.count, e.severity) for e in back] == [
        (48, 4, Severity.WARNING),
        (79, 1, Severity.WARNING),
    ]
    assert back[0].attr("pod_uid") == "1f0c6e2a-3b4d-4c5e-9f60-7a8b9c0d1e2f"


def test_clears_record_who_when_what(store: EventStore) -> None:
    a = store.add_clear(
        "alice",
        pci_bus_id="0000:00:06.0",
        code=79,
        reason="replaced riser",
        boot_id="boot-a",
        when=T + 5,
    )
    b = store.add_clear("gpu reset", pci_bus_id="0000:00:07.0", reset=True, when=T + 6)
    assert [c.who for c in store.clears_since(T)] == ["alice", "gpu reset"]
    assert store.clears_after(a.id) == [b]
    assert (a.code, a.reason, a.reset, b.reset) == (79, "replaced riser", False, True)


def test_concurrent_writers(store: EventStore) -> None:
    store.max_events = 10_000

    def work(n: int) -> None:
        for i in range(50):
            store.write([Record(ev(13, T + i), f"t{n}-{i}")], {f"src{n}": str(i)})

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.count() == 200
    assert {store.load_cursor(f"src{n}") for n in range(4)} == {"49"}


def test_shares_its_file_with_the_alert_outbox(store: EventStore) -> None:
    from gpuwatchd.sinks.alertmanager.outbox import Outbox

    box = Outbox(store.path)
    store.write([Record(ev(), "x")], {"kmsg": "c"})
    assert store.count() == 1
    box.close()


def test_events_route(store: EventStore) -> None:
    store.write([Record(ev(31, T), "a"), Record(ev(79, T + 1), "b")])
    route = events_route(store)
    status, ctype, body = route({"limit": ["1"]})
    assert (status, ctype) == (200, "application/json")
    data = json.loads(body)
    assert data["count"] == 1 and data["events"][0]["code"] == 79
    assert data["events"][0]["time_iso"] == "2023-11-14T22:13:21Z"
    assert json.loads(route({"code": ["31"]})[2])["events"][0]["code"] == 31
    assert route({"limit": ["many"]})[0] == 400
    assert json.loads(route({"limit": ["100000"]})[2])["count"] == 2


def test_an_events_page_stops_at_its_byte_bound_newest_first(store: EventStore) -> None:
    store.write([Record(ev(31, T + i), f"b{i}") for i in range(40)])
    whole = events_route(store)({"limit": ["40"]})[2]
    route = events_route(store, max_bytes=len(whole) // 3)
    status, _, body = route({"limit": ["40"]})
    data = json.loads(body)
    assert status == 200 and len(body) <= len(whole) // 3
    assert data["truncated"] is True and 0 < data["count"] == len(data["events"]) < 40
    assert data["events"][0]["time"] == json.loads(whole)["events"][0]["time"]  # the newest
    assert json.loads(whole)["truncated"] is False
