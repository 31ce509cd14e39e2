"""Kernel log parsing on real captured lines (tests/fixtures/kmsg).

The kmsg source is tested in test_kmsg_source.py, line shapes the captures lack
in test_kmsg_line_shapes.py.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.sources.kmsg.parse import KmsgParser, normalize_bus_id, parse_line
from tests.sources.kmsg_files import FIX

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
