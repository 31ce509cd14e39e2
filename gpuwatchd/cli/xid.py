"""`gpuwatchd xid explain CODE...` and `gpuwatchd xid scan [FILE|-]`.

The operator's first-response tool: paste `dmesg` or `journalctl -k`
into it and read, per GPU, what happened and what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, TextIO

from gpuwatchd.app import CommandContext
from gpuwatchd.health.xid import catalog as xid
from gpuwatchd.health.xid import nvlink5
from gpuwatchd.health.xid.catalog import Catalog, XidInfo
from gpuwatchd.model import Action, Severity
from gpuwatchd.pci import UNKNOWN_BUS
from gpuwatchd.sources.kmsg.parse import GPU, SXID, UNPARSED, XID, KmsgParser, KmsgRecord

__all__ = ["explain", "register", "scan"]

FALLEN_OFF_CODE = 79  # Xid 79, "GPU has fallen off the bus"
FALLEN_LINES = 10  # the text and its Xid 79 line come within this many lines

_COLORS = {
    Severity.CRITICAL: "\033[1;31m",
    Severity.WARNING: "\033[33m",
    Severity.INFO: "\033[36m",
    Severity.OK: "",
}
_RESET = "\033[0m"
_BOLD = "\033[1m"


def register(subparsers: Any) -> None:
    """Add `xid explain` and `xid scan` to the CLI."""
    parser = subparsers.add_parser(
        "xid", help="explain Xid/SXid codes, or find them in kernel log text"
    )
    sub = parser.add_subparsers(metavar="ACTION")

    ex = sub.add_parser(
        "explain",
        help="what an Xid (or SXid) means and what to do",
        description="Explain Xid codes; SXid (NVSwitch) codes are 5 digits or written sxid:N.",
    )
    ex.add_argument("codes", nargs="+", metavar="CODE", help="e.g. 79, 13, sxid:12028")
    _common(ex)
    ex.set_defaults(func=_quiet_pipe(explain))

    sc = sub.add_parser(
        "scan",
        help="list the Xid/SXid reports in kernel log text (dmesg, journalctl, syslog, container"
        " logs, JSON exports)",
        description="Read kernel log text and explain every Xid/SXid in it, then summarise.",
    )
    sc.add_argument("file", nargs="?", default="-", help="log file (.gz ok); - or none: stdin")
    sc.add_argument(
        "--fail-on",
        choices=("info", "warning", "critical"),
        help="exit 1 when a report at or above this severity is found",
    )
    sc.add_argument(
        "--include-userspace",
        action="store_true",
        help="also count Xid lines written from user space (ignored by default)",
    )
    _common(sc)
    sc.set_defaults(func=_quiet_pipe(scan))
    parser.set_defaults(func=lambda _a: (parser.print_help(sys.stderr), os.EX_USAGE)[1])


def _quiet_pipe(command: Callable[[CommandContext], int]) -> Callable[[CommandContext], int]:
    """Run `command`; a reader that went away (`| head`) ends it quietly, exit 0."""

    def run(ctx: CommandContext) -> int:
        try:
            return command(ctx)
        except BrokenPipeError:
            # stdout is gone: point it at /dev/null so the final flush cannot fail again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 0

    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--config", metavar="FILE", help="apply the site's xid overrides from FILE")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")


def _catalog(ctx: CommandContext) -> Catalog:
    return xid.from_config(ctx.config) if ctx.config_path else xid.default_catalog()


class _Style:
    def __init__(self, mode: str, stream: TextIO) -> None:
        tty = hasattr(stream, "isatty") and stream.isatty()
        self.on = mode == "always" or (mode == "auto" and tty and not os.environ.get("NO_COLOR"))

    def sev(self, s: Severity, width: int = 8) -> str:
        text = f"{s!s:<{width}}"
        return f"{_COLORS[s]}{text}{_RESET}" if self.on and _COLORS[s] else text

    def bold(self, text: str) -> str:
        return f"{_BOLD}{text}{_RESET}" if self.on else text


def _width() -> int:
    return max(60, min(120, shutil.get_terminal_size((100, 20)).columns))


def _wrap(text: str, indent: str, width: int) -> str:
    return textwrap.fill(
        text, width=width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
    )


# --- explain ---------------------------------------------------------------------


def _parse_code(text: str) -> tuple[str, int]:
    kind = "xid"
    raw = text.strip().lower()
    for prefix, k in (("sxid:", "sxid"), ("sxid", "sxid"), ("xid:", "xid"), ("xid", "xid")):
        if raw.startswith(prefix):
            kind, raw = k, raw[len(prefix) :]
            break
    code = int(raw)
    if code < 0:
        raise ValueError(text)
    if kind == "xid" and code >= 10000 and not text.lower().startswith("xid"):
        kind = "sxid"  # Xid codes are small; NVSwitch SXids are 5 digits
    return kind, code


def explain(ctx: CommandContext) -> int:
    """Print name, severity, action and remediation for each code."""
    args: Any = ctx.args
    cat = _catalog(ctx)
    out: TextIO = sys.stdout
    style = _Style(args.color, out)
    width = _width()
    rc = 0
    for i, text in enumerate(args.codes):
        try:
            kind, code = _parse_code(text)
        except ValueError:
            print(f"gpuwatchd xid explain: not a code: {text!r}", file=sys.stderr)
            rc = 2
            continue
        info = cat.lookup(code, kind)
        if args.json:
            data = info.to_json()
            data["action_text"] = cat.action_text(info.action)
            data["line_overrides"] = [_override_json(o) for o in info.line_overrides]
            out.write(json.dumps(data) + "\n")
            continue
        if i:
            out.write("\n")
        if not info.known:
            out.write(style.bold(f"{code} · unknown code") + "\n")
            out.write(
                _wrap(
                    f"Not in the catalog as an Xid or an NVSwitch SXid (read as "
                    f"{'an SXid: 5 digits' if kind == 'sxid' else 'an Xid'}); a report of it"
                    " is kept and handled with the catalog's fallback:",
                    "  ",
                    width,
                )
                + "\n"
            )
        title = f"{info.label} · {info.name}" + ("" if info.known else " (not in the catalog)")
        out.write(style.bold(title) + "\n")
        out.write(f"  severity   {style.sev(info.severity)}  category  {info.category}\n")
        out.write(
            _wrap(f"{info.action}: {cat.action_text(info.action)}", " " * 13, width).replace(
                " " * 13, "  action     ", 1
            )
            + "\n"
        )
        for j, o in enumerate(info.line_overrides):
            label = "line says " if j == 0 else ""
            cond = f'"{o.contains}"' if o.contains else f'"{o.recovery_action}"'
            arrow = f"{cond:<24} -> {o.severity}, {o.action}"
            out.write(f"  {label:<11}{arrow}\n" if j == 0 else f"  {'':<11}{arrow}\n")
        for r in nvlink5.rules() if kind == "xid" and info.line_overrides else ():
            if r.xid == code:  # decoded before the Fatal/Nonfatal word
                sub = "" if r.subcode is None else f" subcode {r.subcode}"
                out.write(f"  {'unit ' + r.unit + sub:<35} -> {r.severity}, {r.action}\n")

        if info.mnemonic:
            out.write(f"  mnemonic   {info.mnemonic}\n")
        out.write(_wrap(info.remediation, " " * 13, width).replace(" " * 13, "  what to do ", 1))
        out.write("\n")
    return rc


def _override_json(o: xid.LineOverride) -> dict[str, str]:
    return {
        "when_line_contains": o.contains,
        "when_recovery_action_is": o.recovery_action,
        "severity": str(o.severity),
        "action": str(o.action),
    }


# --- scan ------------------------------------------------------------------------


@dataclass
class _Group:
    kind: str
    code: int
    bus: str
    info: XidInfo
    reports: int = 0
    first: str = ""
    last: str = ""
    processes: dict[str, None] = field(default_factory=dict)
    uuid: str = ""
    detail: str = ""


@dataclass
class ScanResult:
    """What a scan found (also returned for tests)."""

    lines: int = 0
    reports: list[dict[str, Any]] = field(default_factory=list)
    unparsed: list[str] = field(default_factory=list)
    userspace: int = 0


def _open(path: str) -> IO[str]:
    if path == "-":
        return sys.stdin
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _records(lines: Iterable[str], result: ScanResult) -> Iterator[KmsgRecord]:
    parser = KmsgParser(year=time.localtime().tm_year)
    for line in lines:
        result.lines += 1
        yield from parser.feed(line)
    yield from parser.flush()


def report_json(rec: KmsgRecord, info: XidInfo, uuid: str) -> dict[str, Any]:
    """One report as `scan --json` prints it."""
    return {
        "kind": rec.kind,
        "code": rec.code,
        "pci_bus_id": rec.pci_bus_id,
        "uuid": uuid,
        "pid": rec.pid,
        "process": rec.process,
        "name": info.name,
        "severity": str(info.severity),
        "action": str(info.action),
        "category": info.category,
        "known": info.known,
        "time": rec.wall_time,
        "kernel_time": rec.boot_seconds,
        "stamp": rec.stamp,
        "detail": rec.detail,
        "origin": rec.origin,
        "device": rec.device,
        "fatal": rec.fatal,
        "link": rec.link,
        "subcode": rec.subcode,
        "recovery_action": rec.recovery_action,
        "inferred": rec.synthetic,
        "extras": dict(rec.extras),
        "raw": rec.message,
        "remediation": info.remediation,
    }


def scan(ctx: CommandContext) -> int:
    """Find and explain every Xid/SXid in kernel log text, then summarise."""
    args: Any = ctx.args
    cat = _catalog(ctx)
    out: TextIO = sys.stdout
    style = _Style(args.color, out)
    try:
        stream = _open(args.file)
    except OSError as exc:
        print(f"gpuwatchd xid scan: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return os.EX_NOINPUT  # sysexits: an input file that cannot be read
    result = ScanResult()
    uuids: dict[str, str] = {}
    groups: dict[tuple[str, int, str], _Group] = {}
    worst = Severity.OK
    printed_header = False
    fallen: dict[str, int] = {}  # bus id -> line of an inferred Xid 79 ("fallen off the bus")
    with contextlib.nullcontext(stream) if stream is sys.stdin else stream:
        for rec in _records(stream, result):
            if rec.kind == GPU:
                uuids[rec.pci_bus_id] = rec.uuid
                continue
            if rec.kind == UNPARSED:
                result.unparsed.append(rec.message)
                continue
            if rec.kind not in (XID, SXID):
                continue
            if rec.origin == "user" and not args.include_userspace:
                result.userspace += 1
                continue
            if rec.kind == XID and rec.code == FALLEN_OFF_CODE:
                # the text and its Xid 79 line are one event, as in the daemon
                seen = fallen.get(rec.pci_bus_id)
                if rec.synthetic:
                    fallen[rec.pci_bus_id] = result.lines
                elif seen is not None and result.lines - seen <= FALLEN_LINES:
                    del fallen[rec.pci_bus_id]
                    continue
            info = cat.resolve(rec.code, rec.kind, rec.detail, rec.fatal, rec.recovery_action)
            uuid = uuids.get(rec.pci_bus_id, "")
            data = report_json(rec, info, uuid)
            result.reports.append(data)
            worst = max(worst, info.severity)
            key = (rec.kind, rec.code, rec.pci_bus_id)
            g = groups.get(key)
            if g is None:
                bus = rec.pci_bus_id or UNKNOWN_BUS
                g = groups[key] = _Group(rec.kind, rec.code, bus, info, first=_when(rec))
            elif info.severity > g.info.severity:
                g.info = info
            g.reports += 1
            g.last = _when(rec)
            g.detail = rec.detail or g.detail
            g.uuid = uuid or g.uuid
            if rec.process or rec.pid is not None:
                g.processes[_proc(rec)] = None
            if args.json:
                out.write(json.dumps(data) + "\n")
            else:
                if not printed_header:
                    out.write(
                        style.bold(
                            _row("SEVERITY", "CODE", "GPU / SWITCH", "WHEN", "PROCESS", "WHAT")
                        )
                        + "\n"
                    )
                    printed_header = True
                out.write(_event_line(rec, info, style) + "\n")
            out.flush()
    if not args.json:
        _summary(out, style, result, groups, cat)
    threshold = Severity.parse(args.fail_on) if args.fail_on else None
    return 1 if threshold is not None and result.reports and worst >= threshold else 0


def _when(rec: KmsgRecord) -> str:
    """One width for every input format: local date and time, else time since boot."""
    if rec.wall_time is not None:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.wall_time))
    if rec.boot_seconds is not None:
        return f"boot+{rec.boot_seconds:.3f}s"
    return rec.stamp[:19] or "-"


def _proc(rec: KmsgRecord) -> str:
    if not rec.process:
        return f"pid {rec.pid}" if rec.pid is not None else "-"
    return f"{rec.process}[{rec.pid}]" if rec.pid is not None else rec.process


def _row(sev: str, code: str, where: str, when: str, proc: str, what: str) -> str:
    return f"{sev:<8}  {code:<10} {where:<14} {when:<20} {proc:<24} {what}"


def _event_line(rec: KmsgRecord, info: XidInfo, style: _Style) -> str:
    label = f"{'SXid' if rec.kind == 'sxid' else 'Xid'} {rec.code}"
    what = info.name
    if rec.detail and rec.detail.rstrip(".") != info.name:
        what = f"{info.name}: {rec.detail}"
    if len(what) > 90:
        what = what[:89] + "…"
    proc = _proc(rec)
    gi, ci = rec.extra("gpu_instance"), rec.extra("compute_instance")
    if gi:  # a MIG GPU: name the instance the report is about
        what = f"[GI {gi}{f' CI {ci}' if ci else ''}] {what}"
    line = _row("", label, rec.pci_bus_id or UNKNOWN_BUS, _when(rec), proc, what)
    return style.sev(info.severity) + line[8:]


# Which action wins when one device has several: the most disruptive fix first.
_ACTION_RANK = {
    Action.DRAIN_AND_INSPECT: 5,
    Action.REBOOT_NODE: 4,
    Action.RESET_GPU: 3,
    Action.CONTACT_SUPPORT: 2,
    Action.RESTART_APP: 1,
    Action.NONE: 0,
}


def _plan(out: TextIO, style: _Style, groups: dict[tuple[str, int, str], _Group]) -> None:
    """One line per device: the strongest action its reports call for, and why."""
    devices: dict[str, list[_Group]] = {}
    for g in groups.values():
        if g.info.severity >= Severity.WARNING:
            devices.setdefault(g.bus, []).append(g)
    if not devices:
        return
    rows = []
    for bus, gs in devices.items():
        top = max(gs, key=lambda g: (_ACTION_RANK[g.info.action], g.info.severity))
        what = ", ".join(
            f"{g.info.label}" + (f" x{g.reports}" if g.reports > 1 else "")
            for g in sorted(gs, key=lambda g: (-g.info.severity, g.code))
        )
        kind = "NVSwitch" if gs[0].kind == "sxid" else "GPU"
        rows.append((-top.info.severity, -_ACTION_RANK[top.info.action], bus, kind, top, what))
    out.write("\nWhat to do, per device:\n")
    for _, _, bus, kind, top, what in sorted(rows):
        out.write(
            f"  {style.sev(top.info.severity)}  {kind:<8} {bus:<13} {str(top.info.action):<18}"
            f" {what}\n"
        )


def _summary(
    out: TextIO,
    style: _Style,
    result: ScanResult,
    groups: dict[tuple[str, int, str], _Group],
    cat: Catalog,
) -> None:
    width = _width()
    n = len(result.reports)
    if not n:
        out.write(f"No Xid or SXid reports in {result.lines} line(s).\n")
    else:
        by_sev: dict[Severity, int] = {}
        for g in groups.values():
            by_sev[g.info.severity] = by_sev.get(g.info.severity, 0) + 1
        counts = ", ".join(f"{v} {k}" for k, v in sorted(by_sev.items(), reverse=True))
        gpus = len({g.bus for g in groups.values()})
        out.write(
            "\n"
            + style.bold(
                f"Summary: {n} report(s) in {result.lines} line(s): {len(groups)} distinct"
                f" ({counts}) on {gpus} device(s)"
            )
            + "\n"
        )
        _plan(out, style, groups)
        ordered = sorted(groups.values(), key=lambda g: (-g.info.severity, g.bus, g.code))
        for g in ordered:
            where = f"GPU {g.bus}" if g.kind == "xid" else f"NVSwitch {g.bus}"
            if g.uuid:
                where += f" ({g.uuid})"
            span = g.first if g.first == g.last else f"{g.first} .. {g.last}"
            out.write(
                f"\n{style.sev(g.info.severity)}  {g.info.label}  {g.info.name}  ·  {where}"
                f"  ·  {g.reports}x" + (f", {span}" if span else "") + "\n"
            )
            if g.processes:
                procs = ", ".join(list(g.processes)[:6])
                more = len(g.processes) - 6
                out.write(f"  who:  {procs}" + (f" and {more} more" if more > 0 else "") + "\n")
            if g.detail and g.detail.rstrip(".") != g.info.name:
                last = g.detail if len(g.detail) <= width - 10 else g.detail[: width - 11] + "…"
                out.write(f"  last: {last}\n")
            action = f"{g.info.action}: {cat.action_text(g.info.action)}"
            out.write(_wrap(action, "        ", width).replace("        ", "  do:   ", 1) + "\n")
            out.write(
                _wrap(g.info.remediation, "        ", width).replace("        ", "  why:  ", 1)
            )
            out.write("\n")
    if result.unparsed:
        out.write(
            f"\n{len(result.unparsed)} line(s) look like an Xid but could not be read, e.g.:\n"
            f"  {result.unparsed[0][:200]}\n"
        )
    if result.userspace:
        out.write(
            f"\n{result.userspace} Xid line(s) were written by user space, not the kernel,"
            " and were ignored (--include-userspace to count them).\n"
        )
