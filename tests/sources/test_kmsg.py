"""Kernel log parsing and the kmsg source, on real captured lines (tests/fixtures/kmsg)."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config, KmsgConfig, PathsConfig, SourcesConfig
from gpuwatchd.model import Event, Gpu, GpuInventory, Sample
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.parse import KmsgParser, normalize_bus_id, parse_line
from gpuwatchd.sources.kmsg.source import KmsgSource

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "kmsg"
ALL_LINES = [
    (f.name, i, line)
    for f in sorted(FIX.glob("*.txt"))
    for i, line in enumerate(f.read_text().splitlines(), 1)
]


def line_of(name: str, number: int) -> str:
    return (FIX / name).read_text().splitlines()[number - 1]


def records(name: str) -> list:
    p = KmsgParser(year=2025)
    out = []
    for line in (FIX / name).read_text().splitlines():
        out += p.feed(line)
    return out + p.flush()


# --- one line at a time: every format the field produces ------------------------

CASES = [
    # file, line, expected fields
    (
        "h200-xid31-kmsg.txt",
        2,
        dict(
            kind="xid",
            code=31,
            pci_bus_id="0000:00:06.0",
            pid=650,
            process="python3",
            origin="kernel",
            facility=0,
            sequence=373,
            boot_seconds=48.494739,
        ),
    ),
    (
        "h200-xid31-kmsg.txt",
        4,
        dict(
            kind="gpu", pci_bus_id="0000:00:06.0", uuid="GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"
        ),
    ),
    ("h200-xid31-kmsg.txt", 6, dict(kind="xid", code=31, boot_seconds=48.494739, origin="unknown")),
    ("h200-xid31-kmsg.txt", 8, dict(kind="xid", code=79, origin="user", facility=1, pid=4242)),
    (
        "dmesg-T-h100-xid119.txt",
        3,
        dict(
            kind="xid",
            code=119,
            pci_bus_id="0000:9b:00.0",
            pid=2024380,
            process="nvidia-smi",
            stamp="Feb 23 16:24:18 2025",
        ),
    ),
    (
        "dmesg-T-h100-xid119.txt",
        1,
        dict(kind="gpu", uuid="GPU-509665ad-b600-ac93-3616-d754b23d636d"),
    ),
    (
        "dmesg-T-xid13-xid109.txt",
        2,
        dict(kind="xid", code=13, pid=None, process="", pci_bus_id="0000:cb:00.0"),
    ),
    (
        "dmesg-T-xid13-xid109.txt",
        5,
        dict(kind="xid", code=109, pid=1797828, process="pt_main_thread"),
    ),
    (
        "syslog-xid13-gpc.txt",
        2,
        dict(
            kind="xid",
            code=13,
            origin="kernel",
            host="Gipfeli",
            boot_seconds=82659.755933,
            stamp="Feb 15 17:37:45",
        ),
    ),
    (
        "dmesg-xid13-unknown-pid.txt",
        1,
        dict(kind="xid", code=13, pid=None, process="", boot_seconds=93297.027938),
    ),
    (
        "dmesg-h100-nvswitch-sxid22013.txt",
        3,
        dict(
            kind="sxid",
            code=22013,
            fatal=False,
            link=44,
            device="nvidia-nvswitch3",
            pci_bus_id="0000:04:00.0",
        ),
    ),
    (
        "dmesg-iso-decode-sxid12028.txt",
        1,
        dict(
            kind="sxid",
            code=12028,
            origin="kernel",
            pci_bus_id="0000:84:00.0",
            fatal=None,
            wall_time=1737801294.859532,
        ),
    ),
    ("nvlink5-xid144-150.txt", 1, dict(kind="xid", code=144, fatal=False, link=0, subcode=0)),
    ("nvlink5-xid144-150.txt", 2, dict(kind="xid", code=149, fatal=True, link=0, subcode=38)),
    ("nvlink5-xid144-150.txt", 3, dict(kind="xid", code=149, fatal=True, subcode=37)),
    (
        "nvlink5-xid144-150.txt",
        4,
        dict(kind="xid", code=149, fatal=True, link=-1, subcode=0, pci_bus_id="0019:01:00.0"),
    ),
    ("nvlink5-xid144-150.txt", 5, dict(kind="xid", code=145, fatal=False, link=13, subcode=0)),
    (
        "nvlink5-xid144-150.txt",
        6,
        dict(kind="xid", code=94, pid=1234, process="python3", detail="Contained ECC error"),
    ),
    (
        "dmesg-gb200-xid149-xid154.txt",
        2,
        dict(kind="xid", code=154, recovery_action="Drain and Reset"),
    ),
    (
        "dmesg-gb200-xid149-xid154.txt",
        4,
        dict(kind="xid", code=154, recovery_action="GPU Reset Required", pci_bus_id="0019:01:00.0"),
    ),
    ("dmesg-gb200-xid149-xid154.txt", 6, dict(kind="xid", code=149, fatal=True, link=15)),
    (
        "fallen-off-bus-single.txt",
        1,
        dict(kind="xid", code=79, pci_bus_id="0000:44:00.0", synthetic=False),
    ),
    (
        "fallen-off-bus-single.txt",
        2,
        dict(kind="xid", code=79, pci_bus_id="0000:29:00.0", synthetic=True),
    ),
    (
        "fallen-off-bus-single.txt",
        3,
        dict(kind="xid", code=79, pci_bus_id="0000:01:00.0", synthetic=True),
    ),
    (
        "fallen-off-bus-single.txt",
        7,
        dict(kind="xid", code=79, pid=None, pci_bus_id="0000:05:00.0"),
    ),
    (
        "journal-xid45-after-nvlink5.txt",
        1,
        dict(
            kind="xid",
            code=45,
            pid=1818990,
            process="python3",
            detail="Ch 00000001 caused by previous Xid 149",
        ),
    ),
    (
        "dmesg-xid31-mmu-fault.txt",
        1,
        dict(kind="gpu", uuid="GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d"),
    ),
    ("dmesg-xid31-mmu-fault.txt", 2, dict(kind="xid", code=31, pid=None)),
    ("dmesg-xid31-mmu-fault.txt", 6, dict(kind="xid", code=32)),
    ("dmesg-xid31-mmu-fault.txt", 9, dict(kind="xid", code=31, pid=13705, process="UnrealEditor")),
    (
        "dmesg-xid31-mmu-fault.txt",
        11,
        dict(kind="xid", code=31, pid=11461, process="", pci_bus_id="0000:0c:00.0"),
    ),
    (
        "journal-xid13-wrapped.txt",
        1,
        dict(kind="xid", code=13, pid=1773, process=".gala-wrapped", origin="kernel"),
    ),
    (
        "journal-xid119-gsp-nvc.txt",
        1,
        dict(
            kind="xid",
            code=119,
            pid=1582259,
            process="nvc:[driver]",
            pci_bus_id="0002:00:00.0",
            boot_seconds=16450076.435595,
        ),
    ),
    ("logger-injected-xid74.txt", 1, dict(kind="xid", code=74, link=14, pci_bus_id="0000:d8:00.0")),
    ("dmesg-x-userspace-drill.txt", 3, dict(kind="xid", code=31, origin="user")),
    ("redacted-and-malformed.txt", 1, dict(kind="unparsed")),
    ("redacted-and-malformed.txt", 2, dict(kind="unparsed")),
]


@pytest.mark.parametrize(("name", "number", "expected"), CASES, ids=lambda v: str(v)[:40])
def test_real_lines(name: str, number: int, expected: dict) -> None:
    rec = parse_line(line_of(name, number), year=2025)
    assert rec is not None
    got = {k: getattr(rec, k) for k in expected}
    if "wall_time" in expected:
        assert got.pop("wall_time") == pytest.approx(expected.pop("wall_time"))
    assert got == expected


@pytest.mark.parametrize(
    ("name", "number", "extras"),
    [
        ("dmesg-T-xid13-xid109.txt", 2, {"gpc": "7", "tpc": "7", "sm": "0"}),
        ("syslog-xid13-gpc.txt", 8, {"gpc": "1", "tpc": "2", "sm": "0"}),
        (
            "h200-xid31-kmsg.txt",
            2,
            {"engine": "GRAPHICS", "gpc": "0", "access_type": "ACCESS_TYPE_VIRT_WRITE"},
        ),
        ("dmesg-xid31-mmu-fault.txt", 10, {"engine": "CE0", "fault_type": "FAULT_PTE"}),
        ("nvlink5-xid144-150.txt", 5, {"unit": "RLW_RXPIPE", "error_status": "0x00000008"}),
        ("dmesg-gb200-xid149-xid154.txt", 2, {"previous_recovery_action": "None"}),
    ],
)
def test_code_specific_details(name: str, number: int, extras: dict) -> None:
    rec = parse_line(line_of(name, number))
    assert rec is not None
    assert {k: rec.extra(k) for k in extras} == extras


@pytest.mark.parametrize(
    "line",
    [line_of("talos-kern-nvrm-no-xid.txt", n) for n in range(1, 7)]
    + [
        line_of("dmesg-T-h100-xid119.txt", 19),  # "...for GPU at PCI:0000:9b:00 (printing 1..."
        line_of("dmesg-fallen-off-bus-multiline.txt", 4),
        "Nov 21 12:00:00 host sshd[42]: Accepted publickey for root",
        "",
        "[   1.000000] pci 0000:00:06.0: [10de:2335] type 00 class 0x030200",
    ],
)
def test_lines_that_are_not_reports(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize(("name", "number", "line"), ALL_LINES, ids=lambda v: str(v)[:30])
def test_every_fixture_line_parses_without_surprises(name: str, number: int, line: str) -> None:
    rec = parse_line(line, year=2025)
    m = re.search(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})\): (\d+)", line)
    if m is not None:  # a well-formed driver Xid line: must come out exactly
        assert rec is not None and rec.kind == "xid"
        assert rec.code == int(m.group(2))
        assert rec.pci_bus_id == m.group(1).lower() + ".0"
    if rec is not None and rec.kind in ("xid", "sxid"):
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", rec.pci_bus_id)


# --- what spans lines ----------------------------------------------------------------


def test_multiline_fallen_off_the_bus_is_xid79() -> None:
    recs = records("dmesg-fallen-off-bus-multiline.txt")
    assert [(r.kind, r.code, r.pci_bus_id, r.synthetic) for r in recs] == [
        ("xid", 79, "0000:b3:00.0", True)
    ]
    assert recs[0].boot_seconds == pytest.approx(1843.308145)
    assert recs[0].lines == 3


def test_multiline_fallen_off_in_one_raw_kmsg_record() -> None:
    # /dev/kmsg keeps the three printk lines in one record, newlines escaped
    raw = (
        "3,1201,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5)"
        " installed in this system has\\x0aNVRM: fallen off the bus and is not responding to"
        " commands.\\x0a"
    )
    rec = parse_line(raw)
    assert rec is not None
    assert (rec.kind, rec.code, rec.pci_bus_id, rec.sequence) == ("xid", 79, "0000:b3:00.0", 1201)


def test_textual_fall_off_after_xid79_is_one_incident() -> None:
    p = KmsgParser()
    out = []
    for line in (
        "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        "NVRM: GPU 0000:02:00.0: GPU has fallen off the bus.",
    ):
        out += p.feed(line)
    assert [(r.code, r.pci_bus_id) for r in out] == [(79, "0000:01:00.0"), (79, "0000:02:00.0")]


def test_old_wording_repeats_are_kept() -> None:
    recs = records("fallen-off-bus-single.txt")
    assert [r.pci_bus_id for r in recs if r.kind == "xid"] == [
        "0000:44:00.0",
        "0000:29:00.0",
        "0000:01:00.0",
        "0000:05:00.0",
    ]


def test_fall_off_text_without_its_gpu_line_is_unparsed() -> None:
    p = KmsgParser()
    out = list(p.feed("               NVRM: fallen off the bus and is not responding to commands."))
    assert [r.kind for r in out] == ["unparsed"]


def test_sxid_lines_of_one_report_become_one_record() -> None:
    recs = records("dmesg-h100-nvswitch-sxid22013.txt")
    assert [(r.kind, r.code, r.link, r.fatal, r.lines) for r in recs] == [
        ("sxid", 22013, 44, False, 3),
        ("sxid", 22013, 45, False, 3),
        ("sxid", 22013, 46, False, 2),
    ]
    assert recs[0].extra("data").startswith("Data {0x0000002b")
    assert recs[0].extra("severity") == "Severity 0 Engine instance 44 Sub-engine instance 00"


def test_whole_files_count_reports() -> None:
    expected = {
        "dmesg-T-h100-xid119.txt": ("xid", 119, 5),
        "syslog-xid13-gpc.txt": ("xid", 13, 8),
        "dmesg-xid13-unknown-pid.txt": ("xid", 13, 6),
        "journal-xid45-after-nvlink5.txt": ("xid", 45, 5),
        "dmesg-gb200-xid149-xid154.txt": ("xid", None, 9),
    }
    for name, (kind, code, n) in expected.items():
        recs = [r for r in records(name) if r.kind == kind]
        assert len(recs) == n, name
        if code is not None:
            assert {r.code for r in recs} == {code}, name


# --- bus ids -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("PCI:0000:00:06", "0000:00:06.0"),
        ("0000:00:06", "0000:00:06.0"),
        ("0000:D8:00", "0000:d8:00.0"),
        ("00000000:1B:00.0", "0000:1b:00.0"),  # NVML's 8-digit domain
        ("0000:84:00.0", "0000:84:00.0"),
        ("18:00.0", "0000:18:00.0"),
        ("0019:01:00", "0019:01:00.0"),
        ("10000:01:00.0", "10000:01:00.0"),  # VMD domains exceed 16 bits
        ("...", ""),
        ("PCI:", ""),
        ("0000:zz:00", ""),
        ("0000:00:40.0", ""),  # device numbers stop at 0x1f
        ("0000:00:06.9", ""),
        ("1:0:0", ""),  # the X server's decimal PCI:1:0:0 is not the driver's form
    ],
)
def test_normalize_bus_id(text: str, want: str) -> None:
    assert normalize_bus_id(text) == want


# --- robustness: nothing a line can contain may raise -------------------------------

REAL = [line for _, _, line in ALL_LINES if "Xid" in line or "NVRM" in line]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_random_text_never_raises(text: str) -> None:
    parse_line(text)
    p = KmsgParser()
    p.feed(text)
    p.flush()


@settings(max_examples=600, deadline=None)
@given(
    st.sampled_from(REAL),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 20), st.text(max_size=12)), max_size=4),
)
def test_mutated_real_lines_never_raise(line: str, edits: list) -> None:
    for pos, cut, insert in edits:
        pos %= len(line) + 1
        line = line[:pos] + insert + line[pos + cut :]
    rec = parse_line(line, year=2024)
    if rec is not None and rec.kind in ("xid", "sxid"):
        assert rec.code >= 0
        assert rec.pci_bus_id == normalize_bus_id(rec.pci_bus_id)
    p = KmsgParser(year=2024)
    for piece in line.split("\n"):
        p.feed(piece)
    p.flush()


# --- the source ----------------------------------------------------------------------


def kmsg_config(tmp_path: Path, kmsg_file: Path, **kmsg: object) -> Config:
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001\n")
    procfs = tmp_path / "proc"
    procfs.mkdir(exist_ok=True)
    return Config(
        paths=PathsConfig(kmsg=str(kmsg_file), boot_id=str(boot), procfs=str(procfs)),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="kmsg", **kmsg)),  # type: ignore[arg-type]
    )


def raw(seq: int, msg: str, facility: int = 0, level: int = 4, usec: int | None = None) -> str:
    return f"{facility * 8 + level},{seq},{usec if usec is not None else seq * 1000},-;{msg}\n"


def xid_line(bus: str, code: int, pid: int = 650, name: str = "python3", rest: str = "x") -> str:
    return f"NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name={name}, {rest}"


def source(cfg: Config, **ctx: object) -> KmsgSource:
    clock = FakeClock()
    return KmsgSource(
        cfg,
        SourceContext(clock=clock, **ctx),
        wait=0.05,  # type: ignore[arg-type]
        sleep=lambda s: None,
    )


def events(items: object) -> list[Event]:
    return [i for i in items if isinstance(i, Event)]  # type: ignore[attr-defined]


def sample(items: object, name: str, **labels: str) -> float:
    for i in items:  # type: ignore[attr-defined]
        if (
            isinstance(i, Sample)
            and i.name == name
            and all(i.label(k) == v for k, v in labels.items())
        ):
            return i.value
    raise AssertionError(f"no sample {name}")


def test_source_reads_the_real_h200_record(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    lines = [
        ln
        for ln in (FIX / "h200-xid31-kmsg.txt").read_text().splitlines()
        if re.match(r"\d+,\d+,", ln)
    ]
    kmsg.write_text("\n".join(lines) + "\n")
    src = source(kmsg_config(tmp_path, kmsg))
    out = src.poll(src.clock.time() - src.clock.monotonic() + 50.0)  # 1.5 s after the fault
    evs = events(out)
    assert [(e.kind, e.code, e.pci_bus_id) for e in evs] == [("xid", 31, "0000:00:06.0")]
    ev = evs[0]
    assert ev.attr("pid") == "650" and ev.attr("process") == "python3"
    assert ev.attr("cursor") == "kmsg:6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001:373"
    assert ev.attr("sequence") == "373"
    assert ev.attr("attribution") == "process gone"  # no /proc/650 in our fake root
    assert "FAULT_PDE" in ev.attr("raw")
    # the user-space record (facility 1) is counted, not reported
    assert sample(out, "gpuwatchd_kmsg_spoofed_xid_lines_total") == 1
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 1
    assert src.status()["cursor"] == "kmsg:6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001:374"


def test_accept_userspace_switch(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(5, xid_line("0000:00:06", 79), facility=1))
    out = source(kmsg_config(tmp_path, kmsg, accept_userspace=True)).poll(0.0)
    assert [e.code for e in events(out)] == [79]
    assert events(out)[0].attr("origin") == "user"


def test_event_time_comes_from_the_kernel_timestamp(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid_line("0000:00:06", 31), usec=48_494_739))
    src = source(kmsg_config(tmp_path, kmsg))
    clock = src.clock
    ev = events(src.poll(0.0))[0]
    boot_wall = clock.time() - clock.monotonic()
    assert ev.time == pytest.approx(boot_wall + 48.494739)
    assert ev.attr("kernel_time") == "48.494739"


def test_gpu_index_and_identity_lines_name_the_gpu(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        raw(1, "NVRM: GPU at PCI:0000:00:06: GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6")
        + raw(2, xid_line("0000:00:06", 31))
        + raw(3, xid_line("0000:00:07", 31))
    )
    # NVML's inventory; the driver's line spells the bus id its own way
    index = GpuInventory((Gpu(index=1, uuid="GPU-0000-from-nvml", pci_bus_id="0000:00:07.0"),))
    out = source(kmsg_config(tmp_path, kmsg), gpus=lambda: index).poll(0.0)
    got = [(e.pci_bus_id, e.attr("gpu"), e.attr("uuid")) for e in events(out)]
    assert got == [
        ("0000:00:06.0", "", "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"),
        ("0000:00:07.0", "1", "GPU-0000-from-nvml"),
    ]


def test_unparsed_lines_are_counted_and_logged_once_per_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        raw(1, "NVRM: Xid (PCI:...): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 11 (...)")
        + raw(2, "NVRM: Xid (PCI:...): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 12 (...)")
        + raw(3, "NVRM: Xid (PCI:...): 137, some other shape entirely")
    )
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.sources.kmsg.source"):
        out = source(kmsg_config(tmp_path, kmsg)).poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_unparsed_xid_lines_total") == 3
    assert not events(out)
    logged = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert len(logged) == 2


def test_restart_neither_repeats_nor_misses(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join(raw(i, xid_line("0000:00:06", 13, rest=f"n{i}")) for i in range(1, 4)))
    cfg = kmsg_config(tmp_path, kmsg)
    first = source(cfg)
    seen = [e.attr("sequence") for e in events(first.poll(0.0))]
    cursor = str(first.status()["cursor"])
    first.close()
    # the kernel logged more while we were down; the ring buffer still holds all of it
    with kmsg.open("a") as f:
        f.write("".join(raw(i, xid_line("0000:00:06", 13, rest=f"n{i}")) for i in range(4, 6)))
    second = source(cfg, load_cursor=lambda name: cursor if name == "kmsg" else None)
    seen += [e.attr("sequence") for e in events(second.poll(0.0))]
    assert seen == ["1", "2", "3", "4", "5"]


def test_restart_in_a_new_boot_reads_everything(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join(raw(i, xid_line("0000:00:06", 13)) for i in range(1, 4)))
    cfg = kmsg_config(tmp_path, kmsg)
    old = "kmsg:another-boot:2"
    out = source(cfg, load_cursor=lambda name: old).poll(0.0)
    assert [e.attr("sequence") for e in events(out)] == ["1", "2", "3"]


def test_records_lost_while_down_are_counted(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(10, "usb 1-1: new device") + raw(11, xid_line("0000:00:06", 13)))
    cfg = kmsg_config(tmp_path, kmsg)
    boot = Path(cfg.paths.boot_id).read_text().strip()
    out = source(cfg, load_cursor=lambda name: f"kmsg:{boot}:4").poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_records_lost_total", backend="kmsg") == 5  # 5..9


def test_reader_failure_backs_off_and_reports_reader_down(tmp_path: Path) -> None:
    cfg = kmsg_config(tmp_path, tmp_path / "no-such-kmsg")
    slept: list[float] = []
    clock = FakeClock()
    src = KmsgSource(cfg, SourceContext(clock=clock), wait=0.5, sleep=slept.append)
    opens = 0
    real_opener = src._opener

    def counting(cursor: str | None) -> object:
        nonlocal opens
        opens += 1
        return real_opener(cursor)

    src._opener = counting  # type: ignore[assignment]
    out = src.poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 0
    assert "does not exist" in str(src.status()["error"])
    for _ in range(10):  # ten quick polls within the first second: no reopen storm
        src.poll(0.0)
        clock.advance(0.05)
    assert opens == 1
    assert all(s <= 0.5 for s in slept) and slept, "polls must wait, never spin"
    clock.advance(1.0)
    src.poll(0.0)
    assert opens == 2  # retried after >= 1 s
    clock.advance(1.0)
    src.poll(0.0)
    assert opens == 2  # next wait is 2 s
    # the device appears: the reader comes back and says so
    (tmp_path / "no-such-kmsg").write_text(raw(1, xid_line("0000:00:06", 79)))
    clock.advance(2.0)
    out = src.poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 1
    assert sample(out, "gpuwatchd_kmsg_reader_restarts_total", backend="kmsg") == 1
    assert [e.code for e in events(out)] == [79]


def test_attribution_from_a_kubernetes_pod(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid_line("0000:00:06", 31, pid=4242, name="python3")))
    cfg = kmsg_config(tmp_path, kmsg)
    proc = Path(cfg.paths.procfs) / "4242"
    proc.mkdir()
    (proc / "comm").write_text("python3\n")
    (proc / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        "1f0c6e2a_3b4d_4c5e_9f60_7a8b9c0d1e2f.slice/cri-containerd-" + "ab" * 32 + ".scope\n"
    )
    src = source(cfg)
    # the record is fresh: make the fake clock's "now" match its time
    ev = events(src.poll(src.clock.time() - src.clock.monotonic() + 0.001))[0]
    assert ev.attr("attribution") == "kubernetes"
    assert ev.attr("pod_uid") == "1f0c6e2a-3b4d-4c5e-9f60-7a8b9c0d1e2f"
    assert ev.attr("container_id") == "ab" * 32


def test_old_records_are_not_attributed(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid_line("0000:00:06", 31, pid=1)))
    src = source(kmsg_config(tmp_path, kmsg))
    ev = events(src.poll(src.clock.time() + 3600))[0]
    assert ev.attr("pid") == "1"
    assert "too old" in ev.attr("attribution")


def test_reports_from_a_file_backend(tmp_path: Path) -> None:
    log = tmp_path / "dmesg.log"
    log.write_text((FIX / "dmesg-T-h100-xid119.txt").read_text())
    cfg = kmsg_config(tmp_path, tmp_path / "unused")
    cfg = replace(cfg, sources=SourcesConfig(kmsg=KmsgConfig(backend="file", file=str(log))))
    src = source(cfg)
    evs = events(src.poll(0.0))
    assert len(evs) == 5 and {e.code for e in evs} == {119}
    assert evs[0].attr("uuid") == "GPU-509665ad-b600-ac93-3616-d754b23d636d"
    # dmesg -T stamps are local wall time
    assert evs[0].time == pytest.approx(
        __import__("time").mktime((2025, 2, 23, 16, 24, 18, 0, 0, -1))
    )
    assert "sequence" not in dict(evs[0].attrs)


def test_a_reader_bug_backs_off_instead_of_spinning(tmp_path: Path) -> None:
    class Broken:
        name = "kmsg"

        def read(self, timeout: float) -> list:
            raise ValueError("bug in a reader")

        def cursor(self) -> str:
            return ""

        def take_lost(self) -> int:
            return 0

        def close(self) -> None:
            pass

    cfg = kmsg_config(tmp_path, tmp_path / "kmsg")
    clock = FakeClock()
    opened: list[str | None] = []

    def opener(cursor: str | None) -> Broken:
        opened.append(cursor)
        return Broken()

    src = KmsgSource(cfg, SourceContext(clock=clock), opener=opener, sleep=lambda s: None)
    out = src.poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 0
    assert "bug in a reader" in str(src.status()["error"])
    src.poll(0.0)
    src.poll(0.0)
    assert len(opened) == 1  # no reopen before the backoff


def _switch_report(switch: int, bus: str, link: int, t: float) -> list[str]:
    """The three lines one NVSwitch prints for one SXid 22013 (the shape of the real
    report in dmesg-h100-nvswitch-sxid22013.txt), for switch `switch` and `link`."""
    head = f"[{t:12.6f}] nvidia-nvswitch{switch}: SXid (PCI:{bus}): 22013, "
    return [
        head + f"Data {{0x{link:08x}, 0x{link:08x}, 0x00000000, 0x{link:08x}, 0x80005302,"
        " 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
        head + f"Non-fatal, Link {link} Minion Link DLREQ interrupt",
        head + f"Severity 0 Engine instance {link} Sub-engine instance 00",
    ]


@pytest.mark.parametrize("switches", [3, 4, 8])
def test_interleaved_sxids_of_several_switches_count_one_report_each(switches: int) -> None:
    """Issue 20: switches reporting in the same second interleave their lines; one
    pending group for all turned 3-line reports into one report per line."""
    buses = [f"0000:{0x04 + 0x10 * i:02x}:00.0" for i in range(switches)]
    reports = [
        _switch_report(i, bus, link, 38.17 + 0.001 * link)
        for link in (44, 45)
        for i, bus in enumerate(buses)
    ]
    lines = []  # line k of every switch's report, then line k+1: the worst interleaving
    for link_reports in (reports[:switches], reports[switches:]):
        for k in range(3):
            lines += [r[k] for r in link_reports]
    p = KmsgParser(year=2025)
    out = []
    for line in lines:
        out += p.feed(line)
    out += p.flush()
    assert len(out) == 2 * switches
    got = sorted((r.pci_bus_id, r.link, r.lines, r.fatal) for r in out)
    assert got == sorted((bus, link, 3, False) for bus in buses for link in (44, 45))
    assert all(r.extra("data").startswith(f"Data {{0x{r.link:08x}") for r in out)
    assert all(
        r.extra("severity").endswith(f"instance {r.link} Sub-engine instance 00") for r in out
    )


XID31 = "NVRM: Xid (PCI:0000:3b:00): 31, pid=1773, name=python3, MMU Fault"


@pytest.mark.parametrize(
    "head",
    [
        "",
        "               ",
        "6,1012,4875130,-;",
        "[ 1843.308145] ",
        "[Sun Feb 23 16:24:18 2025] ",
        "kern  :err   : 2025-01-25T10:34:54,859532+00:00 ",
        "Nov 26 10:00:00 gpu-node-17 kernel: ",
        "Nov 26 10:00:00.123456 gpu-node-17 kernel: [ 1843.308145] ",
        "2026-11-26T10:00:00+0000 gpu-node-17 kernel: ",
        "[ 1843.308145] gpu-node-17 kernel: ",
        "<3>1 2026-11-26T10:00:00.123Z gpu-node-17 kernel - - - ",
        "\x1b[32m[ 1843.308145] \x1b[0m",
        "192.168.11.119: kern: warning: [2026-04-22T21:27:51.291660856Z]: ",
    ],
)
def test_an_xid_after_a_kernel_log_head_is_read(head: str) -> None:
    rec = parse_line(head + XID31)
    assert rec is not None and (rec.kind, rec.code) == ("xid", 31)


@pytest.mark.parametrize(
    "head",
    [
        "sudo sh -c \"echo '",
        # sudo logs the command it ran to syslog, beside the kernel's lines
        "Nov 26 10:00:00 gpu-node-17 sudo[4242]:     root : TTY=pts/0 ; PWD=/root ; USER=root ;"
        " COMMAND=/bin/sh -c echo '",
        "$ echo '",
        'root@gpu-node-17:~# echo "',
        "# " * 200,
        "see the ticket: ",
    ],
)
def test_driver_text_quoted_in_other_text_is_no_report(head: str) -> None:
    assert parse_line(head + XID31 + "'") is None
