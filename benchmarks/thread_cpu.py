"""Per-thread CPU and wake-ups of a running process, named from its Python threads.

Reads /proc/PID/task/*/schedstat (nanoseconds on CPU) and the voluntary
context switches of every thread twice, --seconds apart, and prints each
thread's share of one core and its wake-ups per second, busiest first.
Python (before 3.14) does not name its threads for the kernel, so names
come from `py-spy dump` when py-spy is installed (it needs ptrace rights
over the process); otherwise the thread ids are printed alone.

    .venv/bin/python benchmarks/thread_cpu.py --pid PID [--seconds 60] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

_THREAD_LINE = re.compile(r"^Thread (0x[0-9A-Fa-f]+|\d+) \((?:[^)]*)\): \"([^\"]*)\"")


def sample(pid: int) -> dict[int, tuple[int, int]]:
    """{tid: (ns on CPU, voluntary context switches)} for every thread of `pid`."""
    out: dict[int, tuple[int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue  # the thread ended between the listing and the read
        switches = next(
            (int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("voluntary_ctxt")),
            0,
        )
        out[int(task.name)] = (ns, switches)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """{tid: Python thread name} from `py-spy dump`, or {} without it."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {}
    try:
        text = subprocess.run(
            [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names: dict[int, str] = {}
    for line in text.splitlines():
        m = _THREAD_LINE.match(line)
        if m is None:
            continue
        ident = m.group(1)
        tid = int(ident, 16) if ident.startswith("0x") else int(ident)
        names[tid] = m.group(2)
    return names


def measure(pid: int, seconds: float) -> list[dict[str, object]]:
    """Rows of tid, name, % of one core and wake-ups per second, busiest first."""
    names = thread_names(pid)
    before, t0 = sample(pid), time.monotonic()
    time.sleep(seconds)
    after, elapsed = sample(pid), time.monotonic() - t0
    rows: list[dict[str, object]] = []
    for tid, (ns, sw) in after.items():
        ns0, sw0 = before.get(tid, (0, 0))
        rows.append(
            {
                "tid": tid,
                "name": names.get(tid, ""),
                "cpu_percent": round((ns - ns0) / 1e9 / elapsed * 100, 4),
                "wakeups_per_second": round((sw - sw0) / elapsed, 2),
            }
        )
    rows.sort(key=lambda r: -float(r["cpu_percent"]))  # type: ignore[arg-type]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    rows = measure(args.pid, args.seconds)
    total = sum(float(r["cpu_percent"]) for r in rows)  # type: ignore[arg-type]
    print(f"{'tid':>8}  {'thread':28s} {'% of a core':>11} {'wake-ups/s':>10}")
    for r in rows:
        print(
            f"{r['tid']:>8}  {str(r['name'])[:28]:28s} {r['cpu_percent']:>11.4f}"
            f" {r['wakeups_per_second']:>10.2f}"
        )
    print(f"{'':8}  {'total':28s} {total:>11.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": args.seconds, "threads": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
