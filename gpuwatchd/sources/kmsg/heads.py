"""Whether driver text in a line is a kernel record, judged by what stands right before it.

A record reaches a user in many wrappings: dmesg and /dev/kmsg heads,
syslog and journal heads in any locale (`Nov 26`, `nov. 26`, `11月 26`),
RFC 3339 and RFC 5424 stamps, a CRI container log head (`<stamp> stdout F`),
a node-problem-detector status (`Reason:XidError Message:`), a notification
that quotes the syslog line after its own words. `kernel_head()` reads the
text before the driver's message as a run of such pieces and answers where
the record's own head starts, or None when the text is an argument of a
command (`echo '...'`, `logger -t kernel ...`, `--message "..."`, sudo's
`COMMAND=`) or prose. JSON exports are unwrapped first (`json_value()`).

Every pattern is anchored at a position and bounded, and a scan restarts
only at word boundaries, so a hostile line costs time linear in its length.
"""

from __future__ import annotations

import json
import re

__all__ = ["MAX_HEAD", "json_value", "kernel_head"]

_LEVELS = r"(?:emerg|alert|crit|err|warn|warning|notice|info|debug)"
# A month as strftime's %b writes it in any locale: "Nov", "Mär", "nov.", "déc.",
# " 3月" (Japanese, Chinese), " 3월" (Korean).
MONTH = r"(?:[^\W\d_]{2,6}\.?|\d{1,2}[月월])"
_ISO = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d"

# Pieces of a record's head, tried in this order at each position. `stamp`
# pieces start a record's head; `strong` pieces show a kernel log by themselves.
_PIECES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # CRI (containerd, CRI-O): "<RFC 3339 nano> stdout|stderr F|P <message>"
    ("cri", re.compile(r"\d{4}-\d\d-\d\dT\S{1,40} (?:stdout|stderr) [FP] ")),
    # RFC 5424: <pri>1 stamp host app procid msgid structured-data
    (
        "rfc5424",
        re.compile(
            r"(?:<\d{1,3}>)?1 \d{4}-\d\d-\d\dT\S{1,40}(?: \S{1,255}){4} (?:-|\[[^\]]{0,256}\])\s*"
        ),
    ),
    ("bracket", re.compile(r"\[[^\[\]]{0,64}\]:?\s*")),  # [ 38.175561], [Sun Feb 23 ...], [T12]
    ("color", re.compile(r"\x1b\[[0-9;]{0,16}m")),  # dmesg --color=always
    ("priority", re.compile(r"<\d{1,3}>\s*")),
    ("kmsg", re.compile(r"\d{1,4},\d{1,20},\d{1,20}[^;]{0,64};\s*")),  # /dev/kmsg record head
    # journalctl -o short-full: "Thu 2026-11-26 10:00:00 UTC" (weekday localised)
    (
        "iso",
        re.compile(
            r"(?:[^\W\d_]{1,10}\.? )?" + _ISO + r"(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?"
            r"(?: (?:UTC|GMT|[A-Z]{2,5}|[+-]\d{4}))?\s+"
        ),
    ),
    ("iso", re.compile(_ISO + r"\S{0,40}\s+")),  # RFC 3339, short-iso, dmesg --time-format iso
    ("date", re.compile(MONTH + r" {1,2}\d{1,2} \d\d:\d\d:\d\d(?:\.\d{1,9})?\s+")),  # syslog
    ("unix", re.compile(r"\d{9,11}\.\d{1,9}\s+")),  # journalctl -o short-unix
    ("level", re.compile(r"[a-z][a-z0-9]{1,8}\s{0,8}:\s{0,8}" + _LEVELS + r"\s{0,8}:\s*")),
    # node-problem-detector: "... Reason:XidError Message:<the kernel message>"
    ("npd", re.compile(r"Reason:[\w.-]{1,64} Message:")),
    # identifier (kernel:, gala[1773]:), host: (the look-behind keeps a scan linear;
    # a clock's "10:" is none)
    ("ident", re.compile(r"(?<![\w.-])(?!\d\d?:)[\w.-]{1,64}(?:\[\d{1,10}\])?:\s*")),
)
_STAMPS = frozenset({"cri", "rfc5424", "kmsg", "iso", "date", "unix"})


def _candidates(*names: str) -> tuple[tuple[str, re.Pattern[str]], ...]:
    return tuple(p for p in _PIECES if p[0] in names)


# Only the pieces that can start with a line's next character are tried (speed).
_AFTER_DIGIT = _candidates("cri", "rfc5424", "kmsg", "iso", "date", "unix", "ident")
_AFTER_LETTER = _candidates("iso", "date", "level", "npd")  # when no identifier is there
_AFTER = {"[": _candidates("bracket"), "\x1b": _candidates("color")}
_AFTER["<"] = _candidates("rfc5424", "priority")
_AFTER_OTHER = _candidates("ident")
_LETTER_FIRST = _candidates("level", "npd")
# a host name, only right before an ident
_HOST = re.compile(r"(?<![\w.-])(?!\d\d?\s)[\w.-]{1,64}\s+")
_IDENT = _PIECES[-1][1]
_KERNEL = re.compile(r"(?<![\w.-])kernel(?:\[0\])?:")
_STAMP_IN_BRACKET = re.compile(r"\[\s*\d+\.\d+\]|\d\d:\d\d:\d\d")
# journalctl -o export / verbose: the message field, at the line start
_EXPORT = re.compile(r"[ \t]{0,64}MESSAGE=")
_WORD_END = re.compile(r"\S{0,64}\s*")  # the rest of a word (long ones in steps)
_SQ_OPEN = re.compile(r"(?:^|(?<=[\s=(]))'(?=\S)")  # a single quote that opens a string
_SQ_CLOSE = re.compile(r"(?<=\S)'(?=[\s,;)]|$)")
# What marks the text before a record's head as a command that prints it.
_COMMAND = re.compile(
    r"(?:^|[\s;|&(`$#>'\"])(?:echo|printf|print|logger|systemd-cat|sh|bash|zsh|dash|ksh|eval"
    r"|exec|sudo|tee)(?=[\s'\"]|$)|COMMAND=|(?:^|\s)--?[A-Za-z][\w-]{0,63}[= ]?\s*$|[=`'\"(]\s*$"
)
MAX_HEAD = 512  # the text before the driver's message that is looked at
# The heads the daemon meets most (/dev/kmsg, dmesg), answered at once
_COMMON = re.compile(
    r"\d{1,4},\d{1,20},\d{1,20}[^;]{0,64};\s*"  # /dev/kmsg
    r"|\s{0,64}\[\s{0,16}\d{1,12}\.\d{1,9}\]\s*"  # dmesg
    # English syslog and journalctl: "Feb 15 17:37:45 host kernel: [82659.755847] "
    r"|(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d{1,9})? [\w.-]{1,64} )?kernel: "
    r"(?:\[\s{0,16}\d{1,12}\.\d{1,9}\] )?"
)


def kernel_head(prefix: str) -> int | None:
    """Where the kernel record's own head starts in `prefix`, or None: not a record.

    `prefix` is the text before the driver's message. Accepted: nothing (the
    line start); a run of head pieces from the line start; or, after other
    text, a run that shows a kernel log (a stamp, a priority, `kernel:`)
    while the text before it is no command that prints it. Returns the index
    the record's head starts at (what `parse_prefix` reads).
    """
    end = len(prefix)
    if end == 0 or prefix.isspace() or _COMMON.fullmatch(prefix):
        return 0
    base = max(0, end - MAX_HEAD)
    pos = base
    if base == 0 and prefix.endswith("MESSAGE="):
        m = _EXPORT.match(prefix)
        if m is not None and m.end() == end:
            return end
    run = head = pos  # where the current run of pieces starts; its record's head
    strong = stamped = False
    idents = 0
    while pos < end and prefix[pos].isspace():
        pos += 1
    while pos < end:
        kind, stop = _piece(prefix, pos)
        if stop < 0:  # not a head piece: the run starts again at the next word
            w = _WORD_END.match(prefix, pos)
            pos = w.end() if w is not None and w.end() > pos else end
            run = head = pos
            strong = stamped = False
            idents = 0
            continue
        if kind in _STAMPS:
            if stamped or idents:
                head = pos  # a second record head: what came before wraps the record
            strong = stamped = True
            idents = 0
        elif kind == "ident":
            if idents and not stamped:
                head = pos
            idents += 1
            if run and _KERNEL.match(prefix, pos):  # (only asked of a run after other text)
                strong = True
        elif kind in ("priority", "npd") or (
            run and kind == "bracket" and _STAMP_IN_BRACKET.search(prefix, pos, stop)
        ):
            strong = True
        pos = stop
    if run == 0:
        return head
    before = prefix[max(0, run - 128) : run]
    if not strong or _COMMAND.search(before) or _open_quote(before):
        return None
    return head


def _open_quote(text: str) -> bool:
    """Whether `text` leaves a quoted string open (what follows is inside quotes)."""
    if text.count('"') % 2 or text.count("`") % 2:  # a string, a shell or Markdown code span
        return True
    return len(_SQ_OPEN.findall(text)) > len(_SQ_CLOSE.findall(text))


def _piece(prefix: str, pos: int) -> tuple[str, int]:
    """The head piece at `pos` and where it ends (-1: none)."""
    c = prefix[pos]
    if c.isdigit():
        pieces = _AFTER_DIGIT
    elif c.isalpha():
        # An identifier ("kernel:") is the common case; the pieces an identifier's
        # match would hide are "kern: warn:" and node-problem-detector's "Reason:".
        m = _IDENT.match(prefix, pos)
        if m is not None:
            if m.end() - pos <= 12:
                for kind, pattern in _LETTER_FIRST:
                    other = pattern.match(prefix, pos)
                    if other is not None:
                        return kind, other.end()
            return "ident", m.end()
        pieces = _AFTER_LETTER
    else:
        pieces = _AFTER.get(c, _AFTER_OTHER)
    for kind, pattern in pieces:
        m = pattern.match(prefix, pos)
        if m is not None:
            return kind, m.end()
    host = _HOST.match(prefix, pos)
    if host is not None:
        ident = _IDENT.match(prefix, host.end())
        if ident is not None:
            return "ident", ident.end()
    return "", -1


# --- JSON exports --------------------------------------------------------------------

# The field a log shipper or exporter keeps the record in: journalctl -o json
# (MESSAGE), Docker json-file and fluent-bit (log), Vector, Elasticsearch and
# Kubernetes events (message), logcli jsonl (line), structured loggers (msg).
_FIELD = re.compile(r'"(?:MESSAGE|message|Message|msg|log|line)"\s{0,8}:\s{0,8}"')
_DECODER = json.JSONDecoder()
_META = re.compile(
    r'"(_TRANSPORT|__REALTIME_TIMESTAMP|_SOURCE_MONOTONIC_TIMESTAMP)"\s{0,8}:\s{0,8}"([\w.]{1,32})"'
)


def json_value(text: str, start: int) -> tuple[str, int, dict[str, str]] | None:
    """The JSON string the driver text at `start` stands in, decoded.

    Returns the value, where the driver text starts in it, and the journal
    fields of the entry (`_TRANSPORT`, timestamps); None when `start` is not
    inside the value of a record field (`MESSAGE`, `message`, `msg`, `log`,
    `line`). A value cut short by a truncated line is taken up to the line's end.
    """
    opener = None
    for m in _FIELD.finditer(text, max(0, start - MAX_HEAD), start):
        opener = m
    if opener is None:
        return None
    q = opener.end() - 1
    try:
        value, stop = _DECODER.raw_decode(text, q)
    except ValueError:
        value, stop = text[q + 1 :], len(text) + 1
    if not isinstance(value, str) or stop <= start:
        return None  # that field's value ended before the driver text
    # escapes before the driver text decode to fewer characters: find it again, at or before
    offset = start - opener.end()
    at = value.rfind(text[start : start + 9], 0, offset + 9)
    if at < 0:
        return None
    return value, at, dict(_META.findall(text))
