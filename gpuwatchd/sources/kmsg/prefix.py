"""The text before a driver message in a kernel log line: who wrote it, when, where.

Handles a raw /dev/kmsg record head (`priority,sequence,usec,flags;`),
`dmesg` `[ seconds]`, `-T` / `--time-format iso` / `-x` prefixes, syslog
and journalctl heads (`Mon DD HH:MM:SS host kernel:`, RFC 3339 stamps).
Every pattern is anchored or bounded so that a hostile prefix costs time
linear in its length.
"""

from __future__ import annotations

import calendar
import functools
import re
import time
from datetime import datetime
from typing import NamedTuple

from gpuwatchd.sources.kmsg.heads import MONTH

__all__ = ["Prefix", "parse_prefix"]

_RAW = re.compile(r"(\d{1,4}),(\d{1,20}),(\d{1,20}),([^;]*);")
_MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}
# strftime's %b in other locales (glibc's abmon), as journalctl and dmesg -T print it
for _names in (
    "Jan Feb Mär Apr Mai Jun Jul Aug Sep Okt Nov Dez",  # de
    "janv févr mars avril mai juin juil août sept oct nov déc",  # fr
    "ene feb mar abr may jun jul ago sep oct nov dic",  # es
    "gen feb mar apr mag giu lug ago set ott nov dic",  # it
    "jan fev mar abr mai jun jul ago set out nov dez",  # pt
    "jan feb mrt apr mei jun jul aug sep okt nov dec",  # nl
    "sty lut mar kwi maj cze lip sie wrz paź lis gru",  # pl
    "янв фев мар апр мая июн июл авг сен окт ноя дек",  # ru
):
    for _i, _name in enumerate(_names.split(), 1):
        _MONTHS.setdefault(_name.lower(), _i)
_CJK_MONTH = re.compile(r"(\d{1,2})[月월]")
_PRIORITY = re.compile(r"[ \t]{0,64}<\d{1,3}>")
_TAIL = r"(?P<ident>[^\s\[:]+)(?:\[\d+\])?:\s*(?:\[\s*(?P<kboot>\d+\.\d+)\]\s*)?$"
# the English month first: the common case, and the cheaper match
_SYSLOG_EN = re.compile(
    r"^(?P<mon>[A-Z][a-z]{2})\s+(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)? (?P<host>\S+) "
    + _TAIL
)
_SYSLOG = re.compile(
    r"^(?P<mon>"
    + MONTH
    + r")\s+(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)? (?P<host>\S+) "
    + _TAIL
)
_ISO_SYSLOG = re.compile(r"^(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\S*) (?P<host>\S+) " + _TAIL)
# journalctl -o short-full ("Thu 2026-11-26 10:00:00 UTC host kernel:") and -o short-unix
_FULL_SYSLOG = re.compile(
    r"^[^\W\d_]{1,10}\.? (?P<iso>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,9})?)"
    r"(?: (?P<zone>UTC|GMT|[A-Z]{2,5}|[+-]\d{4}))? (?P<host>\S+) " + _TAIL
)
# RFC 5424 after its <PRI>: VERSION TIMESTAMP HOSTNAME APP-NAME PROCID MSGID SD
_RFC5424 = re.compile(
    r"^1 (?P<iso>\d{4}-\d\d-\d\dT\S{1,40}) (?P<host>\S{1,255}) (?P<ident>\S{1,48})"
    r" \S{1,128} \S{1,32} (?:-|\[[^\]]{0,256}\])\s*$"
)
_UNIX_SYSLOG = re.compile(r"^(?P<unix>\d{9,11}\.\d{1,9}) (?P<host>\S+) " + _TAIL)
_MONO_SYSLOG = re.compile(r"^\[\s*(?P<boot>\d+\.\d+)\] (?P<host>\S+) " + _TAIL)
_FACILITY = re.compile(
    r"\b(kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:\s*"
    r"(?:emerg|alert|crit|err|warn|warning|notice|info|debug)\s*:"
)
_ISO = re.compile(r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:[.,](\d+))?(Z|[+-]\d\d:?\d\d)?")
_BOOT = re.compile(r"\[\s*(\d+\.\d+)\]")
_DMESG = re.compile(r"\[\s*(\d+\.\d+)\]\s*$")
_CTIME = re.compile(
    r"\[(?:[^\W\d_]{1,10}\.? )?\s?(" + MONTH + r")\s+(\d{1,2}) (\d\d:\d\d:\d\d) (\d{4})\]"
)


class Prefix(NamedTuple):
    """Who wrote a kernel log line, when, and on which host."""

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
    cjk = _CJK_MONTH.fullmatch(mon)
    month = int(cjk.group(1)) if cjk else _MONTHS.get(mon.rstrip(".").lower())
    if month is None or not 1 <= month <= 12:
        return None
    try:
        return time.mktime((year, month, int(day), hour, 0, 0, 0, 0, -1))
    except (ValueError, OverflowError):
        return None


def parse_prefix(prefix: str, year: int | None) -> Prefix:
    """What the text before the driver's message says: who, when, where."""
    if not prefix or prefix.isspace():
        return Prefix()
    if prefix[0].isspace() or prefix[0] == "<":
        pm = _PRIORITY.match(prefix)  # a syslog priority before the head says nothing more
        prefix = (prefix[pm.end() :] if pm else prefix).lstrip()
        if not prefix:
            return Prefix()
    first = prefix[0]
    if first == "[":
        m = _DMESG.match(prefix)  # the most common text form: "[ 1843.308145] "
        if m is not None:
            return Prefix(boot_seconds=float(m.group(1)), stamp=m.group(1))
        sm = _MONO_SYSLOG.match(prefix)
    elif first.isdigit():
        m = _RAW.match(prefix)
        if m is not None:
            pri, seq, usec = int(m.group(1)), int(m.group(2)), int(m.group(3))
            facility = pri >> 3
            return Prefix(
                origin="kernel" if facility == 0 else "user",
                facility=facility,
                sequence=seq,
                boot_seconds=usec / 1e6,
                stamp=f"{usec / 1e6:.6f}",
            )
        sm = (
            _ISO_SYSLOG.match(prefix)
            or _SYSLOG.match(prefix)
            or _UNIX_SYSLOG.match(prefix)
            or _RFC5424.match(prefix)
        )
    else:
        sm = _SYSLOG_EN.match(prefix)
        if sm is None and " " in prefix[:11]:  # a localised month, a weekday
            sm = _SYSLOG.match(prefix) or _FULL_SYSLOG.match(prefix)
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
        return Prefix(origin=origin, boot_seconds=boot, wall_time=_iso_epoch(im), stamp=im.group(0))
    cm = _CTIME.search(prefix)
    if cm is not None:
        mon, day, hms, yr = cm.groups()
        return Prefix(
            origin=origin,
            boot_seconds=boot,
            wall_time=_local_epoch(int(yr), mon, day, hms),
            stamp=f"{mon} {day} {hms} {yr}",
        )
    return Prefix(origin=origin, boot_seconds=boot, stamp=boot_m.group(1) if boot_m else "")


def _syslog_prefix(sm: re.Match[str], boot: float | None, year: int | None) -> Prefix:
    """`<time> <host> <ident>[pid]: ` (syslog, journalctl): the identifier says who wrote it."""
    gd = sm.groupdict()
    origin = "kernel" if gd["ident"] == "kernel" else "user"
    wall: float | None = None
    if "iso" in gd:
        iso = gd["iso"]
        if gd.get("zone") in ("UTC", "GMT"):
            iso += "Z"
        im = _ISO.match(iso)
        wall = _iso_epoch(im) if im else None
        stamp = gd["iso"]
    elif "unix" in gd:
        stamp = gd["unix"]
        wall = float(stamp)
    elif "mon" in gd:
        stamp = f"{gd['mon']} {gd['day']} {gd['hms']}"
        if year is not None:
            wall = _local_epoch(year, gd["mon"], gd["day"], gd["hms"])
    else:
        stamp = gd["boot"]
        boot = float(gd["boot"])
    return Prefix(origin=origin, boot_seconds=boot, wall_time=wall, stamp=stamp, host=gd["host"])
