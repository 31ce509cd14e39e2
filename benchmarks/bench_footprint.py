"""The daemon's steady-state CPU and memory with every source on, at default intervals.

Runs `gpuwatchd run` for --seconds (default 120) with a scrape every 15 s, as
Prometheus would, then reports the CPU it used (utime + stime from
/proc/PID/stat) as a share of one core, and its RSS at the start and end.

    python benchmarks/bench_footprint.py --replay tests/fixtures/nvml/h200x8-from-h200x2.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scrape import rss_bytes, running_daemon, scrape  # noqa: E402
from benchmarks.report import publish  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replay")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--section", default="")
    args = ap.parse_args()
    with running_daemon(args.replay) as (proc, port):
        time.sleep(5)
        rss0, cpu0, t0 = rss_bytes(proc.pid), cpu_seconds(proc.pid), time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            scrape(port)
            time.sleep(15)
        cpu1, t1, rss1 = cpu_seconds(proc.pid), time.monotonic(), rss_bytes(proc.pid)
    fig = {
        "seconds": round(t1 - t0, 1),
        "cpu_share_of_one_core": (cpu1 - cpu0) / (t1 - t0),
        "rss_start_mib": rss0 / 2**20,
        "rss_end_mib": rss1 / 2**20,
        "source": args.replay or "real NVML",
    }
    rows = [
        f"| NVML data | {fig['source']} |",
        f"| run | {fig['seconds']:.0f} s, all sources at default intervals, a scrape every 15 s |",
        f"| CPU | {fig['cpu_share_of_one_core'] * 100:.2f} % of one core |",
        f"| RSS at start / end | {fig['rss_start_mib']:.1f} / {fig['rss_end_mib']:.1f} MiB |",
    ]
    publish(fig, "Steady-state footprint", rows, args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
