"""One Xid seen by both NVML and the kernel log is one event, the log's."""

from __future__ import annotations

from gpuwatchd.health.xid.merge import XidMerger, richer, same_report
from gpuwatchd.model import Event

T = 1_700_000_000.0


def log_ev(code: int = 31, t: float = T, bus: str = "0000:00:06.0") -> Event:
    return Event(
        "xid", "kmsg", t, code, bus, "MMU Fault", attrs=(("pid", "650"), ("process", "python3"))
    )


def nvml_ev(code: int = 31, t: float = T + 1.6, bus: str = "0000:00:06.0") -> Event:
    # as seen on a real H200: the code and the GPU, no text, ~1.6 s after the launch
    return Event("xid", "nvml", t, code, bus, attrs=(("gpu", "0"), ("uuid", "GPU-544a204b")))


def test_same_report_rules() -> None:
    assert same_report(log_ev(), nvml_ev(), 10)
    assert not same_report(log_ev(), nvml_ev(code=13), 10)
    assert same_report(log_ev(), nvml_ev(bus="00000000:00:06.0"), 10)  # NVML's 8-digit domain
    assert not same_report(log_ev(), nvml_ev(bus="0000:00:07.0"), 10)
    assert not same_report(log_ev(), nvml_ev(t=T + 30), 10)
    no_bus = Event("xid", "nvml", T, 31, "", attrs=(("uuid", "GPU-1"),))
    with_uuid = Event("xid", "kmsg", T, 31, "", attrs=(("uuid", "GPU-1"),))
    assert same_report(no_bus, with_uuid, 10)
    assert not same_report(no_bus, Event("xid", "kmsg", T, 31, ""), 10)


def test_log_first_then_nvml_is_one_event() -> None:
    m = XidMerger(window=10, hold=2)
    assert m.offer(log_ev(), now=100.0) == [log_ev()]
    assert m.offer(nvml_ev(), now=101.6) == []
    assert m.due(200.0) == []
    assert m.merged == 1


def test_nvml_first_waits_and_the_richer_log_record_wins() -> None:
    m = XidMerger(window=10, hold=2)
    assert m.offer(nvml_ev(t=T), now=100.0) == []
    out = m.offer(log_ev(t=T + 0.2), now=100.5)
    assert len(out) == 1
    merged = out[0]
    assert merged.source == "kmsg" and merged.attr("pid") == "650"
    assert merged.attr("uuid") == "GPU-544a204b"  # completed from NVML
    assert merged.attr("confirmed_by") == "nvml"
    assert m.due(200.0) == []


def test_nvml_alone_is_published_after_the_hold() -> None:
    m = XidMerger(window=10, hold=2)
    assert m.offer(nvml_ev(), now=100.0) == []
    assert m.due(101.0) == []
    assert m.due(102.0) == [nvml_ev()]
    assert m.due(103.0) == []


def test_different_xids_are_not_merged() -> None:
    m = XidMerger(window=10, hold=2)
    m.offer(log_ev(code=13), now=100.0)
    assert m.offer(nvml_ev(code=31), now=100.1) == []
    assert m.due(102.2) == [nvml_ev(code=31)]
    sx = Event("sxid", "kmsg", T, 12028, "0000:84:00.0")
    assert m.offer(sx, now=100.0) == [sx]


def test_one_nvml_event_absorbs_one_of_several_log_lines() -> None:
    # Xid 13 often prints several lines per fault; NVML reports it once
    m = XidMerger(window=10, hold=2)
    assert m.offer(nvml_ev(code=13, t=T), now=1.0) == []
    a = m.offer(log_ev(code=13, t=T), now=1.1)
    b = m.offer(log_ev(code=13, t=T + 0.001), now=1.1)
    assert len(a) == 1 and len(b) == 1 and m.merged == 1


def test_richer_keeps_log_values() -> None:
    log = Event("xid", "kmsg", T, 31, "0000:00:06.0", attrs=(("uuid", "GPU-from-log"),))
    out = richer(log, nvml_ev())
    assert out.attr("uuid") == "GPU-from-log" and out.attr("gpu") == "0"


def test_window_zero_turns_merging_off() -> None:
    m = XidMerger(window=0, hold=2)
    assert m.offer(nvml_ev(), now=1.0) == [nvml_ev()]
