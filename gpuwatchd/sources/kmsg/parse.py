"""Kernel log parsing: NVIDIA Xid and NVSwitch SXid reports, in any common format.

`parse_line()` is pure and handles one line: a raw /dev/kmsg record
(`priority,sequence,usec,flags;message`), `dmesg` with `[ seconds]` or
`-T` / `--time-format iso` / `-x` prefixes, syslog and journalctl prefixes
(`Mon DD HH:MM:SS host kernel: ...`, RFC 3339 timestamps) or a bare message.
`KmsgParser` adds what needs more than one line: the multi-line
"fallen off the bus" report and the three lines the NVSwitch driver prints
for one SXid.

Speed matters (a busy node logs a lot): every line first goes through a
substring test, and only lines naming the NVIDIA driver meet a regex.
"""

from __future__ import annotations

import calendar
import functools
import re
import time
from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple

from gpuwatchd.pci import normalize_bus_id

__all__ = [
    "KmsgParser",
    "KmsgRecord",
    "RECOVERY_ACTIONS",
    "normalize_bus_id",
    "parse_line",
    "recovery_action_name",
]

XID, SXID, GPU, UNPARSED = "xid", "sxid", "gpu", "unparsed"
_PART_GPU, _PART_FALLEN = "partial_gpu", "partial_fallen"
FALLEN_OFF_CODE = 79


class KmsgRecord(NamedTuple):
    """One driver report extracted from the kernel log.

    kind: "xid", "sxid", "gpu" (the driver's "GPU at PCI:... GPU-uuid" line)
    or "unparsed" (looks like an Xid but is not one we can read).
    origin: "kernel" or "user" when the format says who wrote the line
    (kmsg facility, `dmesg -x`, syslog identifier), "unknown" otherwise.
    boot_seconds is the kernel's timestamp (CLOCK_MONOTONIC); wall_time is
    an epoch time when the line carries a date.
    """

    kind: str
    code: int = 0
    pci_bus_id: str = ""
    pid: int | None = None
    process: str = ""
    detail: str = ""
    message: str = ""
    origin: str = "unknown"
    facility: int | None = None
    sequence: int | None = None
    boot_seconds: float | None = None
    wall_time: float | None = None
    stamp: str = ""
    host: str = ""
    device: str = ""
    uuid: str = ""
    fatal: bool | None = None
    link: int | None = None
    subcode: int | None = None
    recovery_action: str = ""
    synthetic: bool = False
    extras: tuple[tuple[str, str], ...] = ()
    shape: str = ""
    cursor: str = ""
    lines: int = 1

    def extra(self, key: str, default: str = "") -> str:
        for k, v in self.extras:
            if k == key:
                return v
        return default


# --- bus ids -------------------------------------------------------------------


# --- regexes (only ever run on lines that passed the substring test) ------------

_RAW = re.compile(r"(\d{1,4}),(\d+),(\d+),([^;]*);")
# "NVRM: Xid (PCI:0000:00:06): 31, pid=650, name=python3, <detail>" in one match:
# bus id, code, then the optional pid= and name= (either may be '<unknown>').
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([^)]*)\):\s*(\d+)\s*(?:,\s*)?"
    r"(?:pid=(?:'?<unknown>'?|(\d+))\s*(?:,\s*|$))?"
    r"(?:name=(<unknown>|[^,]{0,64}?)\s*(?:,\s*|$))?"
)
_SXID_RE = re.compile(r"(nvidia-nvswitch\d*): SXid \((?:PCI:)?([^)]*)\):\s*(\d+)\s*(?:,\s*)?")
_GPC = re.compile(r"\(GPC (\d+), TPC (\d+), SM (\d+)\)")
_MMU = re.compile(
    r"ENGINE (\S+) (?:GPC(\d+) )?(\S+) faulted @ (\S+?)\.? Fault is of type (\S+) (\S+)"
)
_NVL5 = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]*)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\s+(?:XC\d+\s+)?(?:i\d+\s+)?"
    r"Link\s+(?P<link>-?\d+)\s*\((?P<regs>[^)]*)\)"
)
_LINK = re.compile(r"\b[Ll]ink\s*(-?\d+)")
_R154 = re.compile(
    r"recovery action changed from (0x[0-9a-fA-F]+|\d+) \(([^)]*)\) to (0x[0-9a-fA-F]+|\d+)"
    r"(?: \(([^)]*)\))?"
)
_SXID_SEV = re.compile(r"^(Fatal|Non-fatal|Nonfatal)\b", re.I)
_IDENT = re.compile(r"NVRM: GPU at PCI:([0-9a-fA-F:.]+): (GPU-[0-9a-fA-F-]+)")
_FALLEN_1 = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?([0-9a-fA-F]+:[0-9a-fA-F:.]+?):? (?:GPU )?has fallen off the bus"
)
_FALLEN_START = re.compile(r"NVRM: The NVIDIA GPU (?:at )?(?:PCI:)?([0-9a-fA-F]+:[0-9a-fA-F:.]+)")
_SHAPE = re.compile(r"\b(?:0x)?[0-9a-fA-F]*\d[0-9a-fA-F]*\b")

_MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}
_TAIL = r"(?P<ident>[^\s\[:]+)(?:\[\d+\])?:\s*(?:\[\s*(?P<kboot>\d+\.\d+)\]\s*)?$"
_SYSLOG = re.compile(
    r"^(?P<mon>[A-Z][a-z]{2})\s+(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)? (?P<host>\S+) "
    + _TAIL
)
_ISO_SYSLOG = re.compile(r"^(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\S*) (?P<host>\S+) " + _TAIL)
_MONO_SYSLOG = re.compile(r"^\[\s*(?P<boot>\d+\.\d+)\] (?P<host>\S+) " + _TAIL)
_FACILITY = re.compile(
    r"\b(kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:\s*"
    r"(?:emerg|alert|crit|err|warn|warning|notice|info|debug)\s*:"
)
_ISO = re.compile(r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:[.,](\d+))?(Z|[+-]\d\d:?\d\d)?")
_BOOT = re.compile(r"\[\s*(\d+\.\d+)\]")
_DMESG = re.compile(r"\s*\[\s*(\d+\.\d+)\]\s*$")
_CTIME = re.compile(r"\[(?:[A-Z][a-z]{2} )?([A-Z][a-z]{2})\s+(\d{1,2}) (\d\d:\d\d:\d\d) (\d{4})\]")


class _Prefix(NamedTuple):
    origin: str = "unknown"
    facility: int | None = None
    sequence: int | None = None
    boot_seconds: float | None = None
    wall_time: float | None = None
    stamp: str = ""
    host: str = ""


def _iso_epoch(m: re.Match[str]) -> float | None:
    date, hms, frac, tz = m.groups()
    h, mi, sec = hms.split(":")
    base = _iso_hour(date, h, tz or "")
    if base is None:
        return None
    return base + int(mi) * 60 + int(sec) + (float(f"0.{frac}") if frac else 0.0)


# Converting a date is the slow part of a report with a wall-clock stamp;
# the start of each hour is computed once (zone changes happen on the hour).
@functools.lru_cache(maxsize=256)
def _iso_hour(date: str, hour: str, tz: str) -> float | None:
    try:
        if not tz:  # no zone: the reader's local time
            return time.mktime(datetime.fromisoformat(f"{date}T{hour}:00:00").timetuple())
        tz = "+00:00" if tz == "Z" else (tz if ":" in tz else f"{tz[:3]}:{tz[3:]}")
        return datetime.fromisoformat(f"{date}T{hour}:00:00{tz}").timestamp()
    except (ValueError, OverflowError):
        return None


def _local_epoch(year: int, mon: str, day: str, hms: str) -> float | None:
    try:
        h, mi, sec = (int(x) for x in hms.split(":"))
    except ValueError:
        return None
    if not (0 <= mi < 60 and 0 <= sec <= 60):
        return None
    base = _local_hour(year, mon, day, h)
    return None if base is None else base + mi * 60 + sec


@functools.lru_cache(maxsize=256)
def _local_hour(year: int, mon: str, day: str, hour: int) -> float | None:
    month = _MONTHS.get(mon)
    if month is None:
        return None
    try:
        return time.mktime((year, month, int(day), hour, 0, 0, 0, 0, -1))
    except (ValueError, OverflowError):
        return None


def _parse_prefix(prefix: str, year: int | None) -> _Prefix:
    """What the text before the driver's message says: who, when, where."""
    if not prefix or prefix.isspace():
        return _Prefix()
    first = prefix[0]
    if first == "[":
        m = _DMESG.match(prefix)  # the most common text form: "[ 1843.308145] "
        if m is not None:
            return _Prefix(boot_seconds=float(m.group(1)), stamp=m.group(1))
        sm = _MONO_SYSLOG.match(prefix)
    elif first.isdigit():
        m = _RAW.match(prefix)
        if m is not None:
            pri, seq, usec = int(m.group(1)), int(m.group(2)), int(m.group(3))
            facility = pri >> 3
            return _Prefix(
                origin="kernel" if facility == 0 else "user",
                facility=facility,
                sequence=seq,
                boot_seconds=usec / 1e6,
                stamp=f"{usec / 1e6:.6f}",
            )
        sm = _ISO_SYSLOG.match(prefix)
    else:
        sm = _SYSLOG.match(prefix)
    boot_m = _BOOT.search(prefix)
    boot = float(boot_m.group(1)) if boot_m else None
    if sm is not None:
        return _syslog_prefix(sm, boot, year)
    origin = "unknown"
    fm = _FACILITY.search(prefix)
    if fm is not None:
        origin = "kernel" if fm.group(1) == "kern" else "user"
    im = _ISO.search(prefix)
    if im is not None:
        return _Prefix(
            origin=origin, boot_seconds=boot, wall_time=_iso_epoch(im), stamp=im.group(0)
        )
    cm = _CTIME.search(prefix)
    if cm is not None:
        mon, day, hms, yr = cm.groups()
        return _Prefix(
            origin=origin,
            boot_seconds=boot,
            wall_time=_local_epoch(int(yr), mon, day, hms),
            stamp=f"{mon} {day} {hms} {yr}",
        )
    return _Prefix(origin=origin, boot_seconds=boot, stamp=boot_m.group(1) if boot_m else "")


def _syslog_prefix(sm: re.Match[str], boot: float | None, year: int | None) -> _Prefix:
    """`<time> <host> <ident>[pid]: ` (syslog, journalctl): the identifier says who wrote it."""
    gd = sm.groupdict()
    origin = "kernel" if gd["ident"] == "kernel" else "user"
    wall: float | None = None
    if "iso" in gd:
        im = _ISO.match(gd["iso"])
        wall = _iso_epoch(im) if im else None
        stamp = gd["iso"]
    elif "mon" in gd:
        stamp = f"{gd['mon']} {gd['day']} {gd['hms']}"
        if year is not None:
            wall = _local_epoch(year, gd["mon"], gd["day"], gd["hms"])
    else:
        stamp = gd["boot"]
        boot = float(gd["boot"])
    return _Prefix(origin=origin, boot_seconds=boot, wall_time=wall, stamp=stamp, host=gd["host"])


# Xid 154 prints "changed from 0x0 (None) to 0x2 (Node Reboot Required)". The
# number is NVML's nvmlDeviceGpuRecoveryAction_t; the words vary by driver
# ("OS Reboot", "PF FLR"), so the number decides when it is there.
RECOVERY_ACTIONS = {
    0: "None",
    1: "GPU Reset Required",
    2: "Node Reboot Required",
    3: "Drain P2P",
    4: "Drain and Reset",
}
_RECOVERY_ALIASES = {
    "none": "None",
    "gpu reset required": "GPU Reset Required",
    "gpu reset": "GPU Reset Required",
    "pf flr": "GPU Reset Required",
    "node reboot required": "Node Reboot Required",
    "node reboot": "Node Reboot Required",
    "os reboot": "Node Reboot Required",
    "drain p2p": "Drain P2P",
    "drain and reset": "Drain and Reset",
}


def recovery_action_name(value: int | None, text: str) -> str:
    """Canonical Xid 154 recovery action from the line's number and/or words."""
    if value is not None and value in RECOVERY_ACTIONS:
        return RECOVERY_ACTIONS[value]
    return _RECOVERY_ALIASES.get(text.strip().lower(), text.strip())


def _int(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _shape(message: str) -> str:
    return _SHAPE.sub("#", message)[:120]


def _xid_facts(code: int, detail: str) -> dict[str, object]:
    """Code-specific fields: NVLink5 subcode/link/severity, 154 action, 13 GPC/TPC/SM."""
    facts: dict[str, object] = {}
    extras: list[tuple[str, str]] = []
    if 144 <= code <= 150:
        m = _NVL5.search(detail)
        if m is not None:
            facts["fatal"] = m.group("sev") == "Fatal"
            facts["link"] = int(m.group("link"))
            regs = m.group("regs").split()
            extras.append(("unit", m.group("unit")))
            try:
                facts["subcode"] = (int(regs[0], 16) >> 20) & 0x3F
                if len(regs) > 1:
                    extras.append(("error_status", regs[1]))
                extras.append(("registers", " ".join(regs)))
            except (ValueError, IndexError):
                pass
    elif code == 154:
        m = _R154.search(detail)
        if m is not None:
            before = recovery_action_name(_int(m.group(1)), m.group(2))
            facts["recovery_action"] = recovery_action_name(_int(m.group(3)), m.group(4) or "")
            extras.append(("previous_recovery_action", before))
    m13 = _GPC.search(detail) if code == 13 else None
    if m13 is not None:
        extras += [("gpc", m13.group(1)), ("tpc", m13.group(2)), ("sm", m13.group(3))]
    if code == 31:
        mm = _MMU.search(detail)
        if mm is not None:
            extras.append(("engine", mm.group(1)))
            if mm.group(2) is not None:
                extras.append(("gpc", mm.group(2)))
            extras += [
                ("client", mm.group(3)),
                ("fault_address", mm.group(4)),
                ("fault_type", mm.group(5)),
                ("access_type", mm.group(6)),
            ]
    if "link" not in facts and "ink" in detail:
        lm = _LINK.search(detail)
        if lm is not None:
            facts["link"] = int(lm.group(1))
    if extras:
        facts["extras"] = tuple(extras)
    return facts


def _record(kind: str, text: str, start: int, year: int | None, **fields: object) -> KmsgRecord:
    p = _parse_prefix(text[:start], year)
    return KmsgRecord(kind, message=text[start:], **p._asdict(), **fields)  # type: ignore[arg-type]


# KmsgRecord's fields after `message` are _Prefix's, in the same order (the
# Xid fast path relies on it).
assert KmsgRecord._fields[7:14] == _Prefix._fields


def parse_line(line: str, *, year: int | None = None) -> KmsgRecord | None:
    """Parse one kernel log line; None when it is not about the NVIDIA driver.

    `year` dates syslog-style stamps that carry none (`Feb 23 16:24:18`);
    without it such records get no wall_time. Never raises.
    """
    rec = _safe_parse(line, year)
    if rec is None or rec.kind == _PART_GPU:
        return None  # half of a multi-line report: only KmsgParser can use it
    if rec.kind == _PART_FALLEN:
        return rec._replace(kind=UNPARSED)
    return rec


def _safe_parse(line: str, year: int | None) -> KmsgRecord | None:
    if "Xid" not in line and "NVRM" not in line:
        return None
    try:
        return _parse(line, year)
    except Exception:  # a parser bug must cost one line, never the reader
        return KmsgRecord(UNPARSED, message=line[:512], shape=_shape(line))


def _parse(line: str, year: int | None) -> KmsgRecord | None:
    text = line.rstrip("\r\n")
    if "\\x0a" in text:  # /dev/kmsg escapes the newlines of a multi-line printk
        text = text.replace("\\x0a", "\n").rstrip("\n")
    m = _XID_RE.search(text)
    if m is not None:
        bus = normalize_bus_id(m.group(1))
        if not bus:
            return _unparsed(text, m.start(), year)
        code = int(m.group(2))
        pid = int(m.group(3)) if m.group(3) else None
        name = m.group(4)
        process = "" if not name or name == "<unknown>" else name.strip()
        detail = text[m.end() :].strip()
        return KmsgRecord(
            XID,
            code,
            bus,
            pid,
            process,
            detail,
            text[m.start() :],
            *_parse_prefix(text[: m.start()], year),
            **_xid_facts(code, detail),  # type: ignore[arg-type]
        )
    m = _SXID_RE.search(text)
    if m is not None:
        bus = normalize_bus_id(m.group(2))
        if not bus:
            return _unparsed(text, m.start(), year)
        detail = text[m.end() :].strip()
        sev = _SXID_SEV.match(detail)
        lm = _LINK.search(detail)
        return _record(
            SXID,
            text,
            m.start(),
            year,
            code=int(m.group(3)),
            pci_bus_id=bus,
            detail=detail,
            device=m.group(1),
            fatal=(sev.group(1).lower() == "fatal") if sev else None,
            link=int(lm.group(1)) if lm else None,
        )
    if "fallen off the bus" in text:
        fm = _FALLEN_1.search(text) or _FALLEN_START.search(text)
        if fm is not None:
            bus = normalize_bus_id(fm.group(1))
            if bus:
                return _record(
                    XID,
                    text,
                    fm.start(),
                    year,
                    code=FALLEN_OFF_CODE,
                    pci_bus_id=bus,
                    detail="GPU has fallen off the bus",
                    synthetic=True,
                )
        start = text.find("NVRM")
        return _record(_PART_FALLEN, text, max(start, 0), year, shape=_shape(text))
    m = _FALLEN_START.search(text)
    if m is not None:
        bus = normalize_bus_id(m.group(1))
        return _record(_PART_GPU, text, m.start(), year, pci_bus_id=bus) if bus else None
    m = _IDENT.search(text)
    if m is not None:
        bus = normalize_bus_id(m.group(1))
        if bus:
            return _record(GPU, text, m.start(), year, pci_bus_id=bus, uuid=m.group(2))
    if "NVRM: Xid" in text or "SXid (" in text:
        start = text.find("NVRM: Xid")
        return _unparsed(text, start if start >= 0 else text.find("SXid ("), year)
    return None


def _unparsed(text: str, start: int, year: int | None) -> KmsgRecord:
    return _record(UNPARSED, text, max(start, 0), year, shape=_shape(text[max(start, 0) :]))


# --- multi-line assembly -----------------------------------------------------------

_EMPTY: tuple[KmsgRecord, ...] = ()
_SXID_PART = re.compile(r"(Data \{|Severity \d)")


def _sxid_part(rec: KmsgRecord) -> str:
    m = _SXID_PART.match(rec.detail)
    if m is None:
        return "main"
    return "data" if m.group(1).startswith("Data") else "severity"


class KmsgParser:
    """`parse_line` plus the reports that span lines.

    - "The NVIDIA GPU <bdf> ... has fallen off the bus" printed over three
      lines (dmesg, journalctl) becomes one Xid 79.
    - The `Data {...}`, `Fatal, Link N ...` and `Severity N ...` lines the
      NVSwitch driver prints for one SXid become one record.
    - A textual fall-off right after the driver's own Xid 79 for the same
      GPU is the same incident and is dropped.
    `flush()` hands out what is still held; call it at the end of a batch.
    """

    def __init__(self, year: int | None = None, window: int = 4) -> None:
        self.year = year
        self.window = window
        self._n = 0
        self._pending: tuple[KmsgRecord, int] | None = None
        self._group: list[KmsgRecord] = []
        self._group_n = 0
        self._recent79: dict[str, int] = {}

    def feed(self, line: str, cursor: str = "") -> Sequence[KmsgRecord]:
        """Records completed by this line (usually none)."""
        self._n += 1
        if "Xid" not in line and "NVRM" not in line:
            return _EMPTY
        rec = _safe_parse(line, self.year)
        if rec is None:
            return _EMPTY
        if cursor:
            rec = rec._replace(cursor=cursor)
        if rec.kind == SXID:
            if self._joins(rec):
                self._group.append(rec)
                return _EMPTY
            held = self.flush() if self._group else []
            self._group, self._group_n = [rec], self._n
            return held
        out: list[KmsgRecord] = self.flush() if self._group else []
        if rec.kind == _PART_GPU:
            self._pending = (rec, self._n)
            return out
        if rec.kind == _PART_FALLEN:
            rec = self._join_fallen(rec)
        if rec.kind == XID and rec.code == FALLEN_OFF_CODE:
            last = self._recent79.get(rec.pci_bus_id)
            self._recent79[rec.pci_bus_id] = self._n
            if rec.synthetic and last is not None and self._n - last <= 10:
                return out
        out.append(rec)
        return out

    def flush(self) -> list[KmsgRecord]:
        """Hand out a held SXid group."""
        if not self._group:
            return []
        group, self._group = self._group, []
        main = next((r for r in group if _sxid_part(r) == "main"), group[0])
        extras = list(main.extras)
        for r in group:
            part = _sxid_part(r)
            if part != "main":
                extras.append((part, r.detail))
        return [main._replace(extras=tuple(extras), lines=len(group), cursor=group[-1].cursor)]

    def _joins(self, rec: KmsgRecord) -> bool:
        if not self._group or self._n - self._group_n > 8:
            return False
        first = self._group[0]
        if (first.pci_bus_id, first.code) != (rec.pci_bus_id, rec.code):
            return False
        return _sxid_part(rec) not in {_sxid_part(r) for r in self._group}

    def _join_fallen(self, rec: KmsgRecord) -> KmsgRecord:
        pending, self._pending = self._pending, None
        if pending is None or self._n - pending[1] > self.window:
            return rec._replace(kind=UNPARSED)
        first = pending[0]
        return first._replace(
            kind=XID,
            code=FALLEN_OFF_CODE,
            synthetic=True,
            detail="GPU has fallen off the bus",
            message=first.message + "\n" + rec.message,
            cursor=rec.cursor or first.cursor,
            lines=self._n - pending[1] + 1,
        )
