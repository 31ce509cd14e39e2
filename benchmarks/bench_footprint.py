"""The daemon's steady-state CPU and memory beside a bare pynvml process, in one run.

Starts `gpuwatchd run` (every source on, default intervals; NVML from a
replay with --replay, else the real library) and, at the same time, the
floor: a bare Python that imports pynvml, initialises NVML (where there is
a driver; without one it only imports pynvml) and sleeps. After a warm-up
both are watched for --seconds while the daemon is scraped every 15 s, as
Prometheus would (its Accept and Accept-Encoding: OpenMetrics, gzip).
Reported for both: RSS at the end, CPU (utime + stime from /proc/PID/stat)
as a share of one core; then the daemon's RSS above
the floor and the ratios. Also the import time of the daemon's modules
(best of 5, minus the floor's import of pynvml).

    python benchmarks/bench_footprint.py --replay tests/fixtures/nvml/h200x8-from-h200x2.json
    python benchmarks/bench_footprint.py                  # on a GPU machine: real NVML
"""

from __future__ import annotations

import argparse
import http.client
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scrape import rss_bytes, running_daemon  # noqa: E402
from benchmarks.report import publish  # noqa: E402

# The floor: what any NVML-reading Python process costs before it does anything.
FLOOR = (
    "import sys, time, pynvml\n"
    "try:\n"
    "    pynvml.nvmlInit()\n"
    "except pynvml.NVMLError:\n"
    "    pass  # no driver here: the floor is the import alone\n"
    "time.sleep(float(sys.argv[1]))\n"
)
# The same floor, its freed heap given back as the daemon gives back its own: glibc keeps
# the heap nvmlInit freed unless the free chunk happens to end at the top, so the
# untrimmed one-liner reads anywhere from 41 to 50 MiB on one H200 (tests/gpu/floor_probe.py);
# trimmed, it is the least a bare pynvml process holds, and the budget is against it.
FLOOR_TRIMMED = FLOOR.replace(
    "time.sleep(", "import ctypes\nctypes.CDLL('libc.so.6').malloc_trim(0)\ntime.sleep("
)
# Targets, in MiB above the floor and share of one core: issue 9's CPU, and issue 23's
# RSS (20 MiB, up from 15, with prometheus_client back in for the exposition).
TARGET_RSS_ABOVE_FLOOR_MIB = 20.0
TARGET_CPU_ONE_GPU = 0.003
TARGET_CPU_8GPU_REPLAY = 0.008
SCRAPE_EVERY = 15.0
# What Prometheus 2.x sends: it gets OpenMetrics, gzipped.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}


def scrape(port: int) -> int:
    """One scrape as Prometheus sends it; the body's length on the wire."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
        return len(conn.getresponse().read())
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_by_mapping(pid: int) -> dict[str, float]:
    """RSS in MiB per kind of mapping: [heap], [anon] (pymalloc arenas, thread heaps and
    stacks, large blocks) or the mapped file's name (a shared library, a database)."""
    out: dict[str, float] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's first line: range, perms, ..., path
            name = head[5].rsplit("/", 1)[-1] if len(head) > 5 else "[anon]"
        elif head[0] == "Rss:":
            out[name] = out.get(name, 0.0) + int(head[1]) / 1024
    return out


def mapping_difference(daemon: dict[str, float], floor: dict[str, float]) -> dict[str, float]:
    """Where the daemon's RSS above the floor lives: the mappings that differ by 0.1 MiB
    or more, largest first."""
    diff = {k: daemon.get(k, 0.0) - floor.get(k, 0.0) for k in {*daemon, *floor}}
    return {
        k: round(v, 2) for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 0.1
    }


def import_seconds(code: str, runs: int = 5) -> float:
    """Best wall time of a fresh interpreter running `code`."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
        best = min(best, time.perf_counter() - t0)
    return best


# What the daemon's imports cost, step by step (each step imports on top of the last).
IMPORT_STEPS: tuple[tuple[str, str], ...] = (
    ("Python alone", "pass"),
    ("+ pynvml (the floor's import)", "import pynvml"),
    (
        "+ HTTP server and prometheus_client (exposition, process collector)",
        "import gpuwatchd.http.server, gpuwatchd.http.exposition, prometheus_client",
    ),
    ("+ sqlite3", "import sqlite3"),
    ("+ the rest of gpuwatchd (daemon, pipeline)", "import gpuwatchd.daemon"),
    ("+ every registered source", "import gpuwatchd.sources as s; s.registry()"),
)
_STEP = (
    "import sys\n"
    "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0]"
    ".split()[1]) / 1024\n"
    "for code in sys.argv[1:]:\n"
    "    exec(code)\n"
    "    print(round(rss(), 1))\n"
)


def import_breakdown() -> list[tuple[str, float]]:
    """(step, RSS in MiB after it) for IMPORT_STEPS, in one fresh interpreter."""
    codes = [code for _, code in IMPORT_STEPS]
    out = subprocess.run(
        [sys.executable, "-c", _STEP, *codes], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return [(name, float(mib)) for (name, _), mib in zip(IMPORT_STEPS, out, strict=True)]


def measure(replay: str | None, seconds: float, warmup: float = 5.0) -> dict[str, Any]:
    """Run the daemon and the floor side by side; their RSS and CPU, and the ratios."""
    life = str(seconds + warmup + 120)
    floor = subprocess.Popen([sys.executable, "-c", FLOOR_TRIMMED, life], cwd=ROOT)
    untrimmed = subprocess.Popen([sys.executable, "-c", FLOOR, life], cwd=ROOT)
    try:
        with running_daemon(replay) as (proc, port):
            time.sleep(warmup)
            pids = {"daemon": proc.pid, "floor": floor.pid, "untrimmed": untrimmed.pid}
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            t0 = time.monotonic()
            wire = 0
            while time.monotonic() - t0 < seconds:
                wire = scrape(port)
                time.sleep(min(SCRAPE_EVERY, max(0.0, seconds - (time.monotonic() - t0))))
            t1 = time.monotonic()
            cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
            rss = {k: rss_bytes(p) / 2**20 for k, p in pids.items()}
            where = mapping_difference(rss_by_mapping(proc.pid), rss_by_mapping(floor.pid))
    finally:
        for p in (floor, untrimmed):
            p.terminate()
            p.wait(10)
    cpu = {k: (cpu1[k] - cpu0[k]) / (t1 - t0) for k in pids}
    return {
        "nvml": replay or "real NVML",
        "seconds": round(t1 - t0, 1),
        "daemon_rss_mib": round(rss["daemon"], 1),
        "floor_rss_mib": round(rss["floor"], 1),
        "untrimmed_floor_rss_mib": round(rss["untrimmed"], 1),
        "rss_above_floor_mib": round(rss["daemon"] - rss["floor"], 1),
        "rss_ratio": round(rss["daemon"] / rss["floor"], 2),
        "daemon_cpu_percent_of_one_core": round(cpu["daemon"] * 100, 3),
        "floor_cpu_percent_of_one_core": round(cpu["floor"] * 100, 3),
        "cpu_above_floor_percent": round((cpu["daemon"] - cpu["floor"]) * 100, 3),
        "scrape_bytes_on_wire": wire,
        "rss_above_floor_by_mapping_mib": where,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", help="NVML capture to replay (default: real NVML)")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--section", default="", help="write this section of docs/benchmarks.md")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    fig = measure(args.replay, args.seconds)
    floor_import = import_seconds("import pynvml")
    daemon_import = import_seconds("import pynvml, gpuwatchd.cli.run, gpuwatchd.daemon")
    fig["import_ms_above_floor"] = round((daemon_import - floor_import) * 1000, 1)
    breakdown = import_breakdown()
    fig["import_rss_mib"] = dict(breakdown)
    cpu_target = TARGET_CPU_8GPU_REPLAY if args.replay else TARGET_CPU_ONE_GPU
    rows = [
        f"| NVML data | {fig['nvml']} |",
        f"| run | {fig['seconds']:.0f} s, every source at default intervals, a scrape every "
        f"{SCRAPE_EVERY:.0f} s |",
        "| floor | `python3 -c 'import pynvml; pynvml.nvmlInit(); time.sleep(...)'` "
        "(nvmlInit only where there is a driver), then `malloc_trim(0)` as the daemon does |",
        f"| the same floor untrimmed (glibc keeps nvmlInit's freed heap or not) | "
        f"{fig['untrimmed_floor_rss_mib']:.1f} MiB |",
        f"| RSS daemon / floor | {fig['daemon_rss_mib']:.1f} / {fig['floor_rss_mib']:.1f} MiB "
        f"(ratio {fig['rss_ratio']:.2f}) |",
        f"| RSS above the floor | {fig['rss_above_floor_mib']:.1f} MiB "
        f"(target <= {TARGET_RSS_ABOVE_FLOOR_MIB:.0f}) |",
        f"| CPU daemon / floor | {fig['daemon_cpu_percent_of_one_core']:.2f} % / "
        f"{fig['floor_cpu_percent_of_one_core']:.2f} % of one core "
        f"(target <= {cpu_target * 100:.1f} %) |",
        f"| import time above the floor (best of 5) | {fig['import_ms_above_floor']:.0f} ms |",
    ]
    last = 0.0
    for name, mib in breakdown:
        rows.append(f"| RSS after import: {name} | {mib:.1f} MiB ({mib - last:+.1f}) |")
        last = mib
    beyond = fig["daemon_rss_mib"] - last
    rows.append(f"| RSS of the running daemon beyond its imports | {beyond:+.1f} MiB |")
    where = ", ".join(
        f"{k} {v:+.1f}" for k, v in list(fig["rss_above_floor_by_mapping_mib"].items())[:6]
    )
    rows.append(f"| RSS above the floor by mapping (MiB, largest) | {where} |")
    publish(fig, "Footprint beside a bare pynvml process", rows, args.section, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
