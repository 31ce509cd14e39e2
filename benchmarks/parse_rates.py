"""How many driver reports in each corpus of kernel log text the parser reads.

A parser change that makes it stricter or looser is judged against every
corpus of real lines in the repository, not only the one it was made for.
For each corpus this prints the lines that hold driver report text (`Xid (`,
`SXid (`, `fallen off the bus`), how many of them `KmsgParser` turns into a
report (a three-line fall-off or SXid counts all its lines), and the rate;
then the same for the kernel's reports of killed and crashed processes (`Killed
process`, `segfault at`, `traps:`, `blocked for more than`) read by `KillParser`.
Lines the corpus marks as not reports (redacted bus ids, driver text inside
a shell command) lower the rate on purpose: their count must not change.

Corpora: every file of tests/fixtures/kmsg (one corpus per directory below
it, its `negatives*` files apart), the kernel records kept in the hang
recordings (tests/fixtures/hangs: trace.json, and the raw /dev/kmsg records
of the dead-rank recordings, *.kmsg), and the fuzz seeds (tests/fuzz/corpus/kmsg). Extra files or
directories may be named on the command line.

    .venv/bin/python benchmarks/parse_rates.py [PATH...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatchd.sources.kmsg.parse import SXID, XID, KmsgParser  # noqa: E402
from gpuwatchd.sources.kmsg.process_kills import KillParser  # noqa: E402

REPORT_TEXT = ("Xid (", "SXid (", "fallen off the bus")
SUFFIXES = (".txt", ".json", ".log", ".jsonl", ".kmsg", "")
# (before 5.0 "Kill process X or sacrifice child" chose; the "Killed process" after it is the kill)
KILL_TEXT = ("Killed process", "segfault at", "traps: ", "blocked for more than")


def _lines(path: Path) -> list[str]:
    if path.suffix == ".json":  # a hang recording: its kernel records, as JSON objects
        data = json.loads(path.read_text())
        return [json.dumps(rec) for rec in data.get("kmsg", [])]
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def rate(files: list[Path]) -> tuple[int, int]:
    """(lines with report text, those read as part of a report)."""
    candidates = read = 0
    for path in files:
        parser = KmsgParser(year=2026)
        lines = _lines(path)
        flags = [any(t in line for t in REPORT_TEXT) for line in lines]
        candidates += sum(flags)
        got: set[int] = set()
        for n, line in enumerate(lines):
            for rec in parser.feed(line, cursor=str(n)):
                if rec.kind in (XID, SXID):
                    last = int(rec.cursor)
                    got.update(range(last - rec.lines + 1, last + 1))
        for rec in parser.flush():
            if rec.kind in (XID, SXID):
                last = int(rec.cursor)
                got.update(range(last - rec.lines + 1, last + 1))
        read += sum(1 for n in got if 0 <= n < len(flags) and flags[n])
    return candidates, read


def kill_rate(files: list[Path]) -> tuple[int, int]:
    """(lines with a kill or crash report's text, those KillParser reads as one)."""
    candidates = read = 0
    for path in files:
        parser = KillParser()
        parser.year = 2026
        for line in _lines(path):
            flagged = any(t in line for t in KILL_TEXT)
            candidates += flagged
            read += flagged and parser.feed(line) is not None
    return candidates, read


def corpora(extra: list[str]) -> Iterator[tuple[str, list[Path]]]:
    kmsg = ROOT / "tests" / "fixtures" / "kmsg"
    for path in sorted(kmsg.glob("*.txt")):
        yield f"tests/fixtures/kmsg/{path.name}", [path]
    for sub in sorted(p for p in kmsg.iterdir() if p.is_dir()):
        logs = [f for f in sorted(sub.rglob("*.*")) if f.suffix in (".txt", ".log", ".jsonl")]
        neg = [f for f in logs if f.name.startswith("negatives")]
        yield f"tests/fixtures/kmsg/{sub.name}/ (positives)", [f for f in logs if f not in neg]
        if neg:
            yield f"tests/fixtures/kmsg/{sub.name}/ (negatives: must stay 0)", neg
    hangs = [p for p in sorted((ROOT / "tests" / "fixtures" / "hangs").glob("*/trace.json"))]
    yield "tests/fixtures/hangs/*/trace.json (kmsg)", hangs
    yield (
        "tests/fixtures/hangs/*/*.kmsg",
        sorted((ROOT / "tests" / "fixtures" / "hangs").glob("*/*.kmsg")),
    )
    yield "tests/fuzz/corpus/kmsg/", sorted((ROOT / "tests" / "fuzz" / "corpus" / "kmsg").iterdir())
    for name in extra:
        p = Path(name)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        yield name, files


def main(argv: list[str]) -> int:
    for title, count in (("Xid/SXid reports", rate), ("kill and crash reports", kill_rate)):
        total_c = total_r = 0
        print(f"{title + ' in corpus':62} {'lines':>6} {'read':>6} {'rate':>7}")
        for name, files in corpora(argv):
            files = [f for f in files if f.suffix in SUFFIXES]
            c, r = count(files)
            if not c and count is kill_rate:
                continue  # a corpus of driver lines only: nothing to say here
            total_c, total_r = total_c + c, total_r + r
            pct = f"{100 * r / c:.1f}%" if c else "-"
            print(f"{name:62} {c:6d} {r:6d} {pct:>7}")
        print(f"{'all':62} {total_c:6d} {total_r:6d} {100 * total_r / max(total_c, 1):6.1f}%\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
