"""The durable alert outbox: versions, resends, retention, bound (SQLite in tmp_path)."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.sinks.alertmanager.outbox import RESOLVED_RETENTION, Outbox, fingerprint

T = 1_700_000_000.0
A = {"alertname": "GpuLost", "severity": "critical", "node": "n", "gpu": "0"}
B = {"alertname": "GpuPcieDegraded", "severity": "warning", "node": "n", "gpu": "1"}
ANN = {"summary": "s", "description": "d"}


def test_due_resend_and_resolve(tmp_path: Path) -> None:
    box = Outbox(str(tmp_path / "db"))
    box.sync([(A, ANN, T - 50)], T)
    [a] = box.due("am1", T, 60)
    assert a.starts_at == T - 50 and a.firing
    box.mark_sent("am1", [a], T)
    assert box.due("am1", T + 59, 60) == []
    assert box.next_due("am1", T + 30, 60) == 30
    assert [x.fingerprint for x in box.due("am1", T + 60, 60)] == [fingerprint(A)]
    assert len(box.due("am2", T, 60)) == 1  # each receiver has its own marks
    # Same condition again after a restart: startsAt stays the stored one.
    box.sync([(A, ANN, T + 100)], T + 100)
    assert box.alerts()[0].starts_at == T - 50
    # Resolve: due at once, then re-sent each interval for 15 minutes, then not.
    box.mark_sent("am1", box.due("am1", T + 100, 60), T + 100)
    result = box.sync([], T + 110)
    assert [x.resolved_at for x in result.resolved] == [T + 110]
    [r] = box.due("am1", T + 111, 60)
    box.mark_sent("am1", [r], T + 111)
    assert box.due("am1", T + 171, 60) != []
    assert box.due("am1", T + 110 + RESOLVED_RETENTION + 61, 60) == []


def test_resolved_but_unsent_is_kept_past_retention(tmp_path: Path) -> None:
    box = Outbox(str(tmp_path / "db"))
    box.sync([(A, ANN, T)], T)
    box.sync([], T + 1)
    late = T + 10 * RESOLVED_RETENTION
    assert box.prune(["am1"], late) == 0  # am1 never heard of it
    assert len(box.due("am1", late, 60)) == 1
    box.mark_sent("am1", box.due("am1", late, 60), late)
    assert box.prune(["am1"], late) == 1
    assert box.alerts() == []


def test_refire_after_resolve_is_a_new_alert(tmp_path: Path) -> None:
    box = Outbox(str(tmp_path / "db"))
    box.sync([(A, ANN, T)], T)
    box.sync([], T + 10)
    result = box.sync([(A, ANN, T + 20)], T + 20)
    assert [(x.starts_at, x.version) for x in result.fired] == [(T + 20, 3)]


def test_text_change_is_redelivered(tmp_path: Path) -> None:
    box = Outbox(str(tmp_path / "db"))
    box.sync([(A, ANN, T)], T)
    box.mark_sent("am1", box.due("am1", T, 60), T)
    box.sync([(A, {**ANN, "description": "worse"}, T)], T + 1)
    [a] = box.due("am1", T + 1, 60)
    assert a.annotations["description"] == "worse" and a.version == 2


def test_bound_evicts_resolved_first_then_drops(tmp_path: Path) -> None:
    box = Outbox(str(tmp_path / "db"), max_alerts=2)
    box.sync([(A, ANN, T)], T)
    box.sync([], T + 1)  # A resolved, still kept
    assert box.sync([(B, ANN, T)], T + 2).dropped == 0
    c = {**B, "gpu": "2"}
    assert box.sync([(B, ANN, T), (c, ANN, T)], T + 3).dropped == 0  # evicted A
    d = {**B, "gpu": "3"}
    assert box.sync([(B, ANN, T), (c, ANN, T), (d, ANN, T)], T + 4).dropped == 1
    assert {x.labels["gpu"] for x in box.alerts()} == {"1", "2"}


def test_survives_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    box = Outbox(path)
    box.sync([(A, ANN, T)], T)
    box.close()
    again = Outbox(path)
    assert [x.labels for x in again.alerts()] == [A]
    assert again.undelivered(["am1"]) == 1 and again.undelivered([]) == 0
