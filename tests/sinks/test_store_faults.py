"""Event store faults: failed writes held and retried, corrupt files, a vanished state dir,
records that do not fit, and the state-dir lock."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from gpuwatchd.model import Event, Severity
from gpuwatchd.sinks.durability import HeldWrites, StateDirLock
from gpuwatchd.sinks.store import EventStore, Record
from tests.sinks.test_store import Clock, ev

T = 1_700_000_000.0


def sev(severity: Severity, code: int) -> Event:
    return Event("xid", "kmsg", T, code, "0000:00:06.0", "m", severity)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(path: Path, clock: Clock) -> EventStore:
    return EventStore(str(path / "state" / "gpuwatchd.db"), clock=clock)


def refuse_writes(store: EventStore, why: str = "disk says no") -> None:
    db = sqlite3.connect(store.path)
    db.execute(
        f"CREATE TRIGGER boom BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, '{why}'); END"
    )
    db.commit()
    db.close()


def allow_writes(store: EventStore) -> None:
    db = sqlite3.connect(store.path)
    db.execute("DROP TRIGGER boom")
    db.commit()
    db.close()


def test_failed_writes_are_held_retried_with_backoff_then_stored(
    tmp_path: Path, clock: Clock
) -> None:
    store = make(tmp_path, clock)
    refuse_writes(store)
    store.write([Record(ev(79), "a")], {"kmsg": "kmsg:boot-a:5"})
    store.write([Record(ev(48), "b")], {"kmsg": "kmsg:boot-a:6"})  # within the backoff: held
    assert store.errors["write"] == 1 and len(store.held) == 2
    assert store.load_cursor("kmsg") is None
    samples = {(s.name, s.labels): s.value for s in store.samples()}
    assert samples[("gpuwatchd_event_store_up", ())] == 0
    assert samples[("gpuwatchd_event_store_held_events", ())] == 2
    clock.now += 60
    store.write([])  # the tick retries: still failing, backoff grows
    assert store.errors["write"] == 2
    allow_writes(store)
    store.write([])  # within the backoff: nothing happens yet
    assert store.count() == 0
    clock.now += 60
    store.write([])
    assert sorted(r["code"] for r in store.recent()) == [48, 79]
    assert store.load_cursor("kmsg") == "kmsg:boot-a:6"
    assert store.problem == "" and len(store.held) == 0
    store.close()


def test_held_writes_drop_info_first_and_never_a_critical() -> None:
    held = HeldWrites(limit=3)
    held.add([(sev(Severity.CRITICAL, 79), "", 1), (sev(Severity.INFO, 1), "", 1)], {})
    held.add([(sev(Severity.WARNING, 2), "", 1), (sev(Severity.INFO, 3), "", 1)], {})
    assert [r[0].code for r in held.rows] == [79, 2, 3]
    held.add([(sev(Severity.CRITICAL, 48), "", 1), (sev(Severity.CRITICAL, 95), "", 1)], {})
    assert [r[0].code for r in held.rows] == [79, 48, 95]
    held.add([(sev(Severity.CRITICAL, 94), "", 1)], {})
    assert [r[0].code for r in held.rows] == [79, 48, 95, 94]  # over the limit: kept
    assert held.dropped == 3


def test_a_record_that_does_not_fit_is_rejected_alone(tmp_path: Path, clock: Clock) -> None:
    store = make(tmp_path, clock)
    huge = ev(2**63, bus="0000:00:07.0")
    store.write(
        [
            Record(ev(79), "a"),
            Record(huge, "b"),
            Record(ev(48, pid="9" * 30), "c"),
            Record(ev(13), "d"),
        ]
    )
    assert sorted(r["code"] for r in store.recent()) == [13, 79]
    assert store.errors["reject"] == 2 and store.errors["write"] == 0
    assert len(store.held) == 0
    store.close()


@pytest.mark.parametrize("damage", ["garbage_header", "garbage_pages", "truncated"])
def test_a_corrupt_database_is_quarantined_and_replaced(
    tmp_path: Path, clock: Clock, damage: str
) -> None:
    store = make(tmp_path, clock)
    store.write([Record(ev(31, pid=str(i)), f"b{i}") for i in range(300)])
    store.close()
    path = Path(store.path)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    data = path.read_bytes()
    if damage == "garbage_header":
        data = b"this is not sqlite" + data[18:]
    elif damage == "garbage_pages":
        data = data[:4096] + os.urandom(len(data) - 4096)
    else:
        data = data[: len(data) // 3 + 100]
    path.write_bytes(data)
    again = make(tmp_path, clock)
    assert len(again.quarantined) == 1 and again.errors["open"] == 1
    assert Path(again.quarantined[0]).read_bytes() == data
    assert ".corrupt-" in again.quarantined[0]
    again.write([Record(ev(79), "new")])
    assert [r["code"] for r in again.recent()] == [79]
    again.close()


def test_a_deleted_state_dir_is_recreated_and_repersisted(tmp_path: Path, clock: Clock) -> None:
    store = make(tmp_path, clock)
    store.write([Record(ev(79), "a")], {"kmsg": "kmsg:boot-a:5"})
    shutil.rmtree(tmp_path / "state")
    store.write([Record(ev(48), "b")], {"kmsg": "kmsg:boot-a:6"})
    assert store.errors["state_dir"] == 1
    assert sorted(r["code"] for r in store.recent()) == [48, 79]
    assert store.load_cursor("kmsg") == "kmsg:boot-a:6"
    reopened = make(tmp_path, clock)
    assert sorted(r["code"] for r in reopened.recent()) == [48, 79]
    reopened.close()
    store.close()


def test_the_state_dir_lock_names_the_holder(tmp_path: Path) -> None:
    first = StateDirLock(str(tmp_path))
    assert first.acquire() is None
    assert StateDirLock(str(tmp_path)).acquire() == os.getpid()
    first.release()
    second = StateDirLock(str(tmp_path))
    assert second.acquire() is None
    second.release()


def test_a_full_disk_then_freed(tmp_path: Path, clock: Clock) -> None:
    """A real 1 MiB tmpfs that fills up: events are held, then written once space frees."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs is not permitted here (the trigger tests cover the logic)")
    try:
        store = EventStore(str(mnt / "state" / "gpuwatchd.db"), clock=clock)
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError:
                pass
        big = "y" * 4000
        for i in range(200):
            store.write([Record(ev(79, pid=str(i), raw=big), f"b{i}")])
            if store.problem:
                break
        assert store.problem and "full" in store.problem.lower()
        held = len(store.held)
        assert held >= 1
        filler.unlink()
        clock.now += 60
        store.write([])
        assert store.problem == "" and len(store.held) == 0
        assert store.count() == i + 1
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_row_that_breaks_a_constraint_is_rejected_not_retried_forever(
    tmp_path: Path, clock: Clock
) -> None:
    store = make(tmp_path, clock)
    broken = Event("xid", "kmsg", T, 79, "0000:00:06.0", None, Severity.CRITICAL)  # type: ignore[arg-type]
    store.write([Record(ev(48), "a"), Record(broken, "b"), Record(ev(95), "c")])
    assert sorted(r["code"] for r in store.recent()) == [48, 95]
    assert store.errors["reject"] == 1 and len(store.held) == 0 and store.problem == ""
    store.close()


def test_a_disk_that_refuses_at_start_gives_a_store_in_memory_until_it_opens(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make(tmp_path, clock)  # an existing store: its cursor stays readable
    first.write([Record(ev(79), "a")], {"kmsg": "kmsg:boot-a:5"})
    first.close()
    real_open = EventStore._open

    def full(self: EventStore) -> sqlite3.Connection:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(EventStore, "_open", full)
    store = make(tmp_path, clock)  # before: StoreError, and the daemon exited 1
    assert store.problem and store.pending()
    assert store.load_cursor("kmsg") == "kmsg:boot-a:5"  # read from the immutable copy
    store.write([Record(ev(48), "b")], {"kmsg": "kmsg:boot-a:6"})
    assert len(store.held) == 1
    monkeypatch.setattr(EventStore, "_open", real_open)
    clock.now += 60
    store.write([])  # the tick's retry opens the file and writes what was held
    assert not store.problem and not store.pending()
    store.close()
    again = make(tmp_path, clock)
    assert again.count() == 2 and again.load_cursor("kmsg") == "kmsg:boot-a:6"
    again.close()
