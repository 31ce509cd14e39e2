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

import re
from collections.abc import Sequence
from typing import NamedTuple

from gpuwatchd.logs import escape_control
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources.kmsg.facts import LINK, RECOVERY_ACTIONS, recovery_action_name, xid_facts
from gpuwatchd.sources.kmsg.heads import json_value, kernel_head
from gpuwatchd.sources.kmsg.prefix import Prefix, parse_prefix

__all__ = [
    "KmsgParser",
    "KmsgRecord",
    "MAX_RECORD",
    "RECOVERY_ACTIONS",
    "normalize_bus_id",
    "parse_line",
    "recovery_action_name",
]

XID, SXID, GPU, UNPARSED = "xid", "sxid", "gpu", "unparsed"
# The kernel's own record size (printk's LOG_LINE_MAX is a little under 1 KiB of
# text, /dev/kmsg records at most 8 KiB): longer lines are cut here and counted.
MAX_RECORD = 8192
# Anything larger is not a driver's report: the line is unparsed, never stored. Codes
# the catalog does not know yet (a newer driver's) are reported, as unknown.
MAX_CODE = 999_999
MAX_PID = 4194304  # PID_MAX_LIMIT
MAX_NESTING = 3  # JSON in JSON (a shipper's record holding a container's JSON log line)
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

# "NVRM: Xid (PCI:0000:00:06): 31, pid=650, name=python3, <detail>" in one match:
# bus id, code, then the optional pid= and name= (either may be '<unknown>').
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([^)]{0,64})\):\s*(\d+)\s*(?:,\s*)?"
    r"(?:pid=(?:'?<unknown>'?|(\d+))\s*(?:,\s*|$))?"
    r"(?:name=(<unknown>|[^,]{0,64}?)\s*(?:,\s*|$))?"
)
_MIG_IDS = re.compile(r"GPU-(I|CI):[ ]{0,4}(\d{1,4})")
_MIG_KEYS = {"I": "gpu_instance", "CI": "compute_instance"}
_SXID_RE = re.compile(
    r"(nvidia-nvswitch\d{0,4}): SXid \((?:PCI:)?([^)]{0,64})\):\s*(\d+)\s*(?:,\s*)?"
)
_SXID_SEV = re.compile(r"^(Fatal|Non-fatal|Nonfatal)\b", re.I)
_IDENT = re.compile(r"NVRM: GPU at PCI:([0-9a-fA-F:.]{1,24}): (GPU-[0-9a-fA-F-]{1,64})")
_FALLEN_1 = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?([0-9a-fA-F]{1,8}:[0-9a-fA-F:.]{1,16}?):?"
    r" (?:GPU )?has fallen off the bus"
)
# The one-line report with its bus id cut away (log shippers truncate and redact)
_FALLEN_NO_BUS = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?:? ?has fallen off the bus")
_FALLEN_START = re.compile(
    r"NVRM: The NVIDIA GPU (?:at )?(?:PCI:)?([0-9a-fA-F]{1,8}:[0-9a-fA-F:.]{1,16})"
)
_DRIVER = re.compile(r"NVRM|nvidia-nvswitch\d{0,4}: SXid")
_SHAPE = re.compile(r"\b(?:0x)?[0-9a-fA-F]*\d[0-9a-fA-F]*\b")


def _bounded(digits: str, limit: int) -> int | None:
    """A decimal field of a report, or None when it is out of any sane range."""
    if len(digits) > len(str(limit)):
        return None
    value = int(digits)
    return value if value <= limit else None


def _shape(message: str) -> str:
    return _SHAPE.sub("#", message[:240])[:120]


def _record(
    kind: str, text: str, start: int, year: int | None, head: int = 0, **fields: object
) -> KmsgRecord:
    p = parse_prefix(text[head:start], year)
    return KmsgRecord(kind, message=text[start:], **p._asdict(), **fields)  # type: ignore[arg-type]


# KmsgRecord's fields after `message` are Prefix's, in the same order (the
# Xid fast path relies on it).
assert KmsgRecord._fields[7:14] == Prefix._fields


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
    if len(line) > MAX_RECORD:
        line = line[:MAX_RECORD]
    try:
        return _parse(line, year)
    except Exception:  # a parser bug must cost one line, never the reader
        return KmsgRecord(UNPARSED, message=line[:512], shape=_shape(line))


def _parse(line: str, year: int | None, depth: int = 0) -> KmsgRecord | None:
    text = line.rstrip("\r\n")
    if '"' in text and depth < MAX_NESTING:
        found = _DRIVER.search(text)
        if found is not None and '"' in text[: found.start()]:
            inner = json_value(text, found.start())
            if inner is not None:  # a JSON export: the record is the field's value
                return _unwrapped(inner[0], inner[2], year, depth)
    if "\\x0a" in text:  # /dev/kmsg escapes the newlines of a multi-line printk
        text = text.replace("\\x0a", "\n").rstrip("\n")
    m = _XID_RE.search(text)
    if m is not None:
        head = kernel_head(text[: m.start()])
        if head is None:
            return None  # driver text quoted in something else (a shell command, notes)
        where = m.group(1)
        # MIG: "(PCI:0000:3b:00 GPU-I:01 GPU-CI:00)" names the GPU and compute instance
        instance = tuple((_MIG_KEYS[k], str(int(v))) for k, v in _MIG_IDS.findall(where))
        bus = normalize_bus_id(_MIG_IDS.sub("", where).strip() if instance else where)
        if not bus:
            return _unparsed(text, m.start(), year, head)
        code = _bounded(m.group(2), MAX_CODE)
        pid = _bounded(m.group(3), MAX_PID) if m.group(3) else None
        if code is None or (m.group(3) and pid is None):
            return _unparsed(text, m.start(), year, head)
        name = m.group(4)
        process = "" if not name or name == "<unknown>" else escape_control(name.strip())
        detail = text[m.end() :].strip()
        facts = xid_facts(code, detail)
        if instance:
            known = facts.get("extras", ())
            facts["extras"] = instance + (known if isinstance(known, tuple) else ())
        return KmsgRecord(
            XID,
            code,
            bus,
            pid,
            process,
            detail,
            text[m.start() :],
            *parse_prefix(text[head : m.start()], year),
            **facts,  # type: ignore[arg-type]
        )
    m = _SXID_RE.search(text)
    if m is not None:
        head = kernel_head(text[: m.start()])
        if head is None:
            return None
        bus = normalize_bus_id(m.group(2))
        if not bus:
            return _unparsed(text, m.start(), year, head)
        code = _bounded(m.group(3), MAX_CODE)
        if code is None:
            return _unparsed(text, m.start(), year, head)
        detail = text[m.end() :].strip()
        sev = _SXID_SEV.match(detail)
        lm = LINK.search(detail)
        return _record(
            SXID,
            text,
            m.start(),
            year,
            head,
            code=code,
            pci_bus_id=bus,
            detail=detail,
            device=m.group(1),
            fatal=(sev.group(1).lower() == "fatal") if sev else None,
            link=int(lm.group(1)) if lm else None,
        )
    if "fallen off the bus" in text:
        fm = _FALLEN_1.search(text) or _FALLEN_START.search(text)
        head = kernel_head(text[: fm.start()]) if fm is not None else 0
        if head is None:
            return None
        if fm is not None:
            bus = normalize_bus_id(fm.group(1))
            if bus:
                return _record(
                    XID,
                    text,
                    fm.start(),
                    year,
                    head,
                    code=FALLEN_OFF_CODE,
                    pci_bus_id=bus,
                    detail="GPU has fallen off the bus",
                    synthetic=True,
                )
        nb = _FALLEN_NO_BUS.search(text)
        head = kernel_head(text[: nb.start()]) if nb is not None else None
        if nb is not None and head is not None:
            # A GPU of this node fell off the bus; which one the line no longer says.
            return _record(
                XID,
                text,
                nb.start(),
                year,
                head,
                code=FALLEN_OFF_CODE,
                detail="GPU has fallen off the bus (the line names no bus id)",
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
        start = start if start >= 0 else text.find("SXid (")
        head = kernel_head(text[:start])
        return _unparsed(text, start, year, head) if head is not None else None
    return None


def _unparsed(text: str, start: int, year: int | None, head: int = 0) -> KmsgRecord:
    start = max(start, 0)
    return _record(UNPARSED, text, start, year, min(head, start), shape=_shape(text[start:]))


def _unwrapped(value: str, meta: dict[str, str], year: int | None, depth: int) -> KmsgRecord | None:
    """The record in a JSON field's value, with what the journal's own fields add."""
    rec = _parse(value[:MAX_RECORD], year, depth + 1)
    if rec is None or not meta:
        return rec
    transport = meta.get("_TRANSPORT")
    if transport and rec.origin == "unknown":  # the journal knows who wrote it
        rec = rec._replace(origin="kernel" if transport == "kernel" else "user")
    mono = meta.get("_SOURCE_MONOTONIC_TIMESTAMP", "")
    if rec.boot_seconds is None and mono.isdigit():
        rec = rec._replace(boot_seconds=int(mono) / 1e6)
    real = meta.get("__REALTIME_TIMESTAMP", "")
    if rec.wall_time is None and real.isdigit():
        rec = rec._replace(wall_time=int(real) / 1e6)
    return rec


# --- multi-line assembly -----------------------------------------------------------

_EMPTY: tuple[KmsgRecord, ...] = ()
_SXID_PART = re.compile(r"(Data \{|Severity \d)")


def _sxid_part(rec: KmsgRecord) -> str:
    m = _SXID_PART.match(rec.detail)
    if m is None:
        return "main"
    return "data" if m.group(1).startswith("Data") else "severity"


MAX_SWITCHES = 64  # pending SXid reports at most (an HGX has 4-18 NVSwitches)
SXID_GAP = 32  # most lines between two lines of one SXid report (other switches' in between)


class _Held(NamedTuple):
    """An SXid report waiting for the rest of its lines."""

    lines: list[KmsgRecord]
    first: int  # line numbers (of all lines fed) of its first and last line
    last: int
    before: str  # the cursor of the line before its first: where to resume to read it again


def _switch(rec: KmsgRecord) -> str:
    """The switch an SXid line comes from: its PCI id (the device name when bus ids repeat)."""
    return f"{rec.device}/{rec.pci_bus_id}"


def _assemble(group: list[KmsgRecord]) -> KmsgRecord:
    """One SXid report from its lines: the main line, with Data and Severity as extras."""
    main = next((r for r in group if _sxid_part(r) == "main"), group[0])
    extras = list(main.extras)
    for r in group:
        part = _sxid_part(r)
        if part != "main":
            extras.append((part, r.detail))
    return main._replace(extras=tuple(extras), lines=len(group), cursor=group[-1].cursor)


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
        # One pending SXid report per switch: switches that report in the same
        # second interleave their lines.
        self._groups: dict[str, _Held] = {}
        self.sxid_lines = 0  # SXid lines fed so far (a reader holds reports while they come)
        self._before = ""  # the cursor of the line fed last
        self._recent79: dict[str, int] = {}
        self.truncated = 0  # lines longer than MAX_RECORD, cut to it

    def feed(self, line: str, cursor: str = "") -> Sequence[KmsgRecord]:
        """Records completed by this line (usually none)."""
        self._n += 1
        before, self._before = self._before, cursor
        if len(line) > MAX_RECORD:
            self.truncated += 1
            line = line[:MAX_RECORD]
        if "Xid" not in line and "NVRM" not in line:
            return _EMPTY
        rec = _safe_parse(line, self.year)
        if rec is None:
            return _EMPTY
        if cursor:
            rec = rec._replace(cursor=cursor)
        if rec.kind == SXID:
            self.sxid_lines += 1
            switch = _switch(rec)
            held = self._groups.get(switch)
            if held is not None and self._joins(held, rec):
                held.lines.append(rec)
                self._groups[switch] = held._replace(last=self._n)
                return _EMPTY
            done = [_assemble(held.lines)] if held is not None else []
            if held is None and len(self._groups) >= MAX_SWITCHES:  # bounded, whatever the log
                oldest = min(self._groups, key=lambda k: self._groups[k].first)
                done.append(_assemble(self._groups.pop(oldest).lines))
            self._groups[switch] = _Held([rec], self._n, self._n, before)
            return done
        out: list[KmsgRecord] = self.flush() if self._groups else []
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

    def holding(self) -> bool:
        """Whether SXid reports wait for more of their lines (`flush()` hands them out)."""
        return bool(self._groups)

    def resume_cursor(self) -> str | None:
        """Where a new reader must start so no held line is lost (None: holding nothing)."""
        if not self._groups:
            return None
        return min(self._groups.values(), key=lambda h: h.first).before

    def flush(self) -> list[KmsgRecord]:
        """Hand out the held SXid reports, in the order they started."""
        if not self._groups:
            return []
        groups = sorted(self._groups.values(), key=lambda h: h.first)
        self._groups = {}
        return [_assemble(h.lines) for h in groups]

    def _joins(self, held: _Held, rec: KmsgRecord) -> bool:
        lines, last = held.lines, held.last
        # A line of the same report follows within a few lines of the same switch's
        # last one, however many other switches print in between.
        if self._n - last > SXID_GAP:
            return False
        if (lines[0].pci_bus_id, lines[0].code) != (rec.pci_bus_id, rec.code):
            return False
        return _sxid_part(rec) not in {_sxid_part(r) for r in lines}

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
