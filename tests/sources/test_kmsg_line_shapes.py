"""Kernel log lines in shapes the captures lack: interleaved NVSwitch SXid reports, the
heads other tools put before the driver's text, and driver text quoted in other text."""

from __future__ import annotations

import pytest

from gpuwatchd.sources.kmsg.parse import KmsgParser, parse_line


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
    ("head", "origin"),
    [
        # syslog and journal heads in other locales (strftime's %b)
        (" 3月 05 10:00:00 gpu-node-17 kernel: ", "kernel"),
        ("11月 26 10:00:00 gpu-node-17 kernel: ", "kernel"),
        (" 3월 05 10:00:00.123456 gpu-node-17 kernel: ", "kernel"),
        ("Mär  5 10:00:00 gpu-node-17 kernel: [   48.494739] ", "kernel"),
        ("mars 05 10:00:00 gpu-node-17 kernel: ", "kernel"),
        ("déc. 05 10:00:00 gpu-node-17 kernel: ", "kernel"),
        ("<4> 3月  5 10:00:00 gpu-node-17 kernel: ", "kernel"),
        ("[dim. nov. 29 00:22:16 2026] ", "unknown"),
        ("[日 11月 29 00:22:16 2026] ", "unknown"),
        ("Thu 2026-03-05 10:00:00 UTC gpu-node-17 kernel: ", "kernel"),
        ("1772704800.494739 gpu-node-17 kernel: ", "kernel"),
        ("<4>1 2026-03-05T10:00:00.494739+00:00 gpu-node-17 kernel - - - ", "kernel"),
        # CRI container log heads, full and partial lines
        ("2026-03-05T10:00:00.494739123Z stdout F ", "unknown"),
        ("2026-03-05T10:00:00.494739123Z stderr P [   48.494739] ", "unknown"),
        ("2026-03-05T10:00:00.494739123Z stdout F Mar  5 10:00:00 gpu-node-17 kernel: ", "kernel"),
        # node-problem-detector's status line, notifications quoting the record
        (
            "I0305 10:00:00.494739    6018 log_monitor.go:159] New status generated:"
            " &{Source:kernel-monitor Events:[{Severity:warn Timestamp:2026-03-05"
            " 10:00:00.494739123 +0000 UTC m=+3230.998142221 Reason:NvidiaXid Message:",
            "unknown",
        ),
        ("[FIRING:1] GpuXidCritical gpu-node-17: Mar  5 10:00:00 gpu-node-17 kernel: ", "kernel"),
        ("*Alert:* GPU error on `gpu-node-17` - Mar  5 10:00:00 gpu-node-17 kernel: ", "kernel"),
        ("Mar  5 10:00:01 relay alert-relay[912]: ticket #4100 opened: <4>", "unknown"),
        # journalctl -o export / verbose
        ("MESSAGE=", "unknown"),
        ("    MESSAGE=", "unknown"),
    ],
)
def test_an_xid_after_a_head_in_any_format_is_read(head: str, origin: str) -> None:
    """Issue 29: what stands right before the driver text decides, not the line's start."""
    rec = parse_line(head + XID31, year=2026)
    assert rec is not None and (rec.kind, rec.code, rec.pid, rec.process) == (
        "xid",
        31,
        1773,
        "python3",
    )
    assert rec.origin == origin


@pytest.mark.parametrize(
    "line",
    [
        '{"MESSAGE":"' + XID31 + '","_TRANSPORT":"kernel"}',
        '{"log":"[   48.494739] ' + XID31 + '\\n","stream":"stdout","time":"2026-03-05T10:00:00Z"}',
        '{"_source":{"message":"Mar  5 10:00:00 gpu-node-17 kernel: ' + XID31 + '"}}',
        '{"labels":{"job":"kmsg"},"line":"' + XID31 + '","timestamp":"2026-03-05T10:00:00Z"}',
        '{"level":"warn","msg":"' + XID31 + '"}',
        '{"log":"{\\"msg\\":\\"' + XID31 + '\\"}"}',  # a container's JSON inside a shipper's
        '    "message": "' + XID31 + '",',  # one line of a pretty-printed export
        '{"message":"' + XID31[:40],  # cut short by a truncating shipper
    ],
)
def test_an_xid_in_a_json_record_field_is_read(line: str) -> None:
    rec = parse_line(line, year=2026)
    assert rec is not None and (rec.kind, rec.code, rec.pci_bus_id) == ("xid", 31, "0000:3b:00.0")


def test_the_journal_fields_of_a_json_export_say_who_wrote_it() -> None:
    fields = ',"__REALTIME_TIMESTAMP":"1772704800494739","_SOURCE_MONOTONIC_TIMESTAMP":"48494739"}'
    kernel = parse_line('{"_TRANSPORT":"kernel","MESSAGE":"' + XID31 + '"' + fields)
    logger = parse_line(
        '{"_TRANSPORT":"syslog","SYSLOG_IDENTIFIER":"kernel","MESSAGE":"' + XID31 + '"}'
    )
    assert kernel is not None and logger is not None
    assert (kernel.origin, kernel.wall_time, kernel.boot_seconds) == (
        "kernel",
        1772704800.494739,
        48.494739,
    )
    assert logger.origin == "user"  # logger -t kernel: the journal knows better


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
        # issue 29: heads that are read now, still inside a command's argument
        "logger -t kernel -p kern.err ",
        'logger -t kernel "Mar  5 10:00:00 gpu-node-17 kernel: ',
        "echo '[   48.494739] ",
        "echo '2026-03-05T10:00:00.494739123Z stdout F ",
        "printf '%s\\n' '<4>",
        'gpu-drill --inject "Mar  5 10:00:00 gpu-node-17 kernel: ',
        "gpu-drill --message=",
        "Mar  5 10:00:00 gpu-node-17 sudo[4242]:     root : COMMAND=/usr/bin/logger -t kernel"
        " Mar  5 10:00:00 gpu-node-17 kernel: ",
        "2026-03-05T10:00:00.494739123Z stdout F + echo '",
        'type=EXECVE msg=audit(1772704800.494:812): argc=3 a0="echo" a1="',
        'the log said "Mar  5 10:00:00 gpu-node-17 kernel: ',
        "the node logged `Mar  5 10:00:00 gpu-node-17 kernel: ",  # quoted, as in notes
        '{"cmd":"echo \'',
        '{"message":"sudo sh -c \\"echo \'',
    ],
)
def test_driver_text_quoted_in_other_text_is_no_report(head: str) -> None:
    assert parse_line(head + XID31 + "'") is None
