"""Multi-line Xid 13 reports are joined report by report: a flood of reports without a pid
never merges into one event, its message stays bounded, and each report counts once."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.health.xid import catalog as xid
from gpuwatchd.health.xid.bursts import MAX_MESSAGE_CHARS, MAX_REPORT_LINES, Bursts
from gpuwatchd.health.xid.tracker import TrackerSettings, XidTracker
from gpuwatchd.model import Event, XidAttribution, XidFields
from gpuwatchd.sources.kmsg.parse import XID, parse_line

T0 = 1_700_000_000.0
BUS = "0000:41:00.0"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg"


def line(t: float, text: str) -> Event:
    """The event the kernel log source makes of one driver line (parsed for real)."""
    rec = parse_line(text)
    assert rec is not None and rec.kind == XID
    attrs = {"gpu": "0", "boot_id": "b", **dict(rec.extras)}
    if rec.pid is not None:
        attrs.update(pid=str(rec.pid), process=rec.process or "")
    return Event("xid", "kmsg", t, rec.code, BUS, rec.detail, attrs=tuple(sorted(attrs.items())))


def report(gpc: int, sm: int) -> list[str]:
    where = f"(GPC {gpc}, TPC 0, SM {sm})"
    return [
        f"NVRM: Xid (PCI:0000:41:00): 13, Graphics SM Warp Exception on {where}:"
        " Out Of Range Address",
        f"NVRM: Xid (PCI:0000:41:00): 13, Graphics SM Global Exception on {where}:"
        " Multiple Warp Errors",
        f"NVRM: Xid (PCI:0000:41:00): 13, Graphics Exception: ESR 0x50{gpc}{sm}30=0x30009"
        " 0x50c734=0x24 0x50c728=0x4c1eb72 0x50c72c=0x174",
    ]


def errors_total(t: XidTracker) -> float:
    return sum(s.value for s in t.samples(T0 + 100) if s.name == "gpuwatchd_xid_errors_total")


def test_a_flood_of_reports_without_pid_counts_each_report_and_stays_bounded() -> None:
    t = XidTracker(xid.default_catalog(), TrackerSettings(), "b")
    reports = [report(g, s) for g in range(8) for s in range(25)]  # 200 reports, 600 lines
    observed = []
    for i, lines in enumerate(reports):  # all within 0.2 s: every line inside the join window
        for j, text in enumerate(lines):
            observed.append(t.observe(line(T0 + i * 0.001 + j * 0.0001, text)))
    assert errors_total(t) == len(reports)  # one per report, not one, not one per line
    assert [o.kind for o in observed].count("line") == 2 * len(reports)
    assert max(len(o.event.message) for o in observed) < 400
    assert max(int(o.event.attr("lines") or 1) for o in observed) == 3
    # the burst collapses the repeats: one burst, every report counted in it
    assert len({o.burst_id for o in observed}) == 1 and observed[-1].count == len(reports)


def test_the_pid_line_completes_its_own_report_only() -> None:
    t = XidTracker(xid.default_catalog(), TrackerSettings(), "b")
    pid_line = (
        "NVRM: Xid (PCI:0000:41:00): 13, pid=4242, name=python3, Graphics Exception:"
        " ChID 0010, Class 0000c7c0, Offset 00000000, Data 00000000"
    )
    obs = [
        t.observe(line(T0 + i * 0.001, text)) for i, text in enumerate([*report(1, 0), pid_line])
    ]
    assert [o.kind for o in obs] == ["new", "line", "line", "line"]
    assert obs[-1].event.attr("pid") == "4242" and obs[-1].event.attr("lines") == "4"
    # the same process's next report: counted once more, its pid line joins it
    nxt = [
        t.observe(line(T0 + 0.01 + i * 0.001, x)) for i, x in enumerate([*report(2, 1), pid_line])
    ]
    assert [o.kind for o in nxt] == ["repeat", "line", "line", "line"]
    assert nxt[-1].event.attr("gpc") == "2" and "GPC 1" not in nxt[-1].event.message
    assert errors_total(t) == 2


def test_burst_pids_are_numeric_windowed_and_current_after_each_change() -> None:
    bursts = Bursts()
    ids = iter(map(str, range(100)))

    def new_id() -> str:
        return next(ids)

    def reported_by(t: float, pid: int) -> Event:
        who = XidAttribution(pid=pid)
        return Event("xid", "kmsg", t, 31, BUS, payload=XidFields(code=31, attribution=who))

    for t, pid in ((0.0, 10), (1.0, 9), (2.0, 100)):
        bursts.observe(reported_by(T0 + t, pid), 60.0, new_id)
    assert bursts.pids(T0 + 2, 60.0) == ["9", "10", "100"]  # numerically, not as text
    assert bursts.pids(T0 + 2, 60.0, most=2) == ["9", "10"]
    assert bursts.pids(T0 + 61.5, 60.0) == ["100"]  # the others' last report left the window
    bursts.observe(reported_by(T0 + 3, 5), 60.0, new_id)
    assert bursts.pids(T0 + 3, 60.0) == ["5", "9", "10", "100"]

    # a report without pid is keyed "" until its pid line names the process
    joined = Bursts()
    pid_line = "NVRM: Xid (PCI:0000:41:00): 13, pid=4242, name=python3, Graphics Exception: x"
    for i, text in enumerate([*report(1, 0), pid_line]):
        ev = line(T0 + i * 0.001, text)
        if joined.join(ev) is None:
            joined.observe(ev, 60.0, new_id)
        assert joined.pids(T0 + 0.01, 60.0) == (["4242"] if "pid=" in text else [])


def test_long_lines_are_capped_at_the_kernel_record_size() -> None:
    t = XidTracker(xid.default_catalog(), TrackerSettings(), "b")
    padding = "x" * 5000
    texts = [f"{text} {padding}" for text in report(3, 3)]
    obs = [t.observe(line(T0 + i * 0.001, text)) for i, text in enumerate(texts)]
    assert [o.kind for o in obs] == ["new", "line", "line"]
    assert len(obs[-1].event.message) == MAX_MESSAGE_CHARS
    assert MAX_REPORT_LINES >= 4  # warp, global, ESR and pid lines of one report fit


def test_a_real_log_of_several_reports_counts_each() -> None:
    # GPC 1 TPC 0 SM 0, SM 1, TPC 2 SM 0...: warp + global + ESR lines per SM, 0.1 ms apart
    t = XidTracker(xid.default_catalog(), TrackerSettings(), "b")
    texts = [
        x for x in (FIXTURES / "syslog-xid13-gpc.txt").read_text().splitlines() if ": 13," in x
    ]
    for i, text in enumerate(texts):
        t.observe(line(T0 + i * 0.0001, text[text.index("NVRM: ") :]))
    # the log starts with an ESR line (its SM lines came before the capture), then three
    # reports of three lines: four reports
    assert len(texts) == 8 and "ESR " in texts[0]
    assert errors_total(t) == 4
