"""The daemon's CPU beside an 8-rank job, on the NVML replay, against the same daemon idle.

Issue 31's goal: the daemon at most 0.6 % of one core while an 8-rank job runs. On a
GPU `tests/gpu/job_cpu.py` measures it; this asks the same question where CI runs.
Local processes stand for the ranks: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT as torchrun sets them, --threads threads each as a PyTorch
rank has, each stepping every 0.2 s (a burst of CPU, a small file write). A copy of a
real 4x H200 capture under load lists their pids as the GPUs' compute processes, two
per GPU. The daemon runs on its defaults (every source on) on that copy, then on the
same copy with no process (the idle node), each for --seconds after a warm-up, scraped
every 15 s as Prometheus would. With --baseline-rev the daemon of that revision
(unpacked with `git archive`) runs beside it in the same phases: the same ranks, the
same machine, the same minutes. The replay's own cost is in both phases; the difference
between them is what the job costs the daemon.

    .venv/bin/python benchmarks/bench_job_cpu.py [--ranks 8] [--threads 64] [--seconds 60]
        [--baseline-rev REV] [--section job-cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_check import revision  # noqa: E402
from benchmarks.bench_footprint import cpu_seconds  # noqa: E402
from benchmarks.bench_scrape import free_port, rss_bytes, running_daemon, scrape  # noqa: E402
from benchmarks.report import update_section  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x4-load-record.json"
SCRAPE_EVERY = 15.0
GOAL_PERCENT = 0.6
# A rank: its threads wait (CUDA, NCCL or gloo, OpenMP), its main thread steps.
RANK = (
    "import os, sys, threading, time\n"
    "for _ in range(int(sys.argv[1]) - 1):\n"
    "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    "out = open(sys.argv[2], 'wb')\n"
    "while True:\n"
    "    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < 0.02:\n"
    "        pass\n"
    "    out.write(b'x' * 4096); out.flush(); out.seek(0)\n"
    "    time.sleep(0.18)\n"
)


def capture_with(pids: list[int], path: Path) -> Path:
    """The load capture with `pids` as its GPUs' compute processes (none: an idle node)."""
    cap = json.loads(CAPTURE.read_text())
    devices = cap["devices"]
    for i, dev in enumerate(devices):
        mine = [p for k, p in enumerate(pids) if k % len(devices) == i]
        for answer in dev["calls"]["compute_running_processes"]:
            answer["value"] = [{"pid": p, "used_memory": 2 << 30} for p in mine]
    path.write_text(json.dumps(cap))
    return path


Daemon = tuple[subprocess.Popen[bytes], int]  # the process and its port


def measure(procs: dict[str, Daemon], warmup: float, seconds: float) -> dict[str, Any]:
    """Each daemon's CPU (% of one core) and RSS over `seconds`, after `warmup`."""
    time.sleep(warmup)
    c0 = {k: cpu_seconds(p.pid) for k, (p, _) in procs.items()}
    t0 = time.monotonic()
    while (left := seconds - (time.monotonic() - t0)) > 0:
        for _, port in procs.values():
            with contextlib.suppress(OSError):
                scrape(port)
        time.sleep(min(SCRAPE_EVERY, left))
    wall = time.monotonic() - t0
    return {
        k: {
            "cpu_percent": 100 * (cpu_seconds(p.pid) - c0[k]) / wall,
            "rss_mib": rss_bytes(p.pid) / 2**20,
            "hangs": hangs(port),
            "job_seen": job_seen(port),
        }
        for k, (p, port) in procs.items()
    }


def hangs(port: int) -> int:
    """Hang records the daemon holds (a healthy job must raise none)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/hangs", timeout=10) as r:
            return int(json.loads(r.read()).get("count", 0))
    except (OSError, ValueError):
        return -1


def job_seen(port: int) -> bool:
    """Whether the daemon groups the ranks into the torch job (its /status names it)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
            return b"torch:127.0.0.1:" in r.read()
    except OSError:
        return False


def phase(trees: dict[str, Path], capture: Path, seconds: float) -> dict[str, Any]:
    """Every tree's daemon on `capture` at once, measured side by side."""
    with contextlib.ExitStack() as stack:
        procs = {
            k: stack.enter_context(running_daemon(str(capture), src=s)) for k, s in trees.items()
        }
        return measure(procs, 15.0, seconds)


def run(trees: dict[str, Path], ranks: int, threads: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-job-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        idle = phase(trees, capture_with([], tmp / "idle.json"), seconds)
        jobs: list[subprocess.Popen[bytes]] = []
        master = free_port()
        try:
            for r in range(ranks):
                env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}
                env.update(WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
                cmd = [sys.executable, "-c", RANK, str(threads), str(tmp / f"rank{r}.out")]
                jobs.append(subprocess.Popen(cmd, env=env))
            job = phase(trees, capture_with([p.pid for p in jobs], tmp / "job.json"), seconds)
        finally:
            for p in jobs:
                p.kill()
                p.wait(10)
    return {"idle": idle, "job": job}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=64, help="threads of each rank")
    ap.add_argument("--seconds", type=float, default=60.0, help="each phase")
    ap.add_argument("--baseline-rev", default="", help="also run this revision's daemon")
    ap.add_argument("--section", default="", help="write this section of docs/benchmarks.md")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        trees = {"this tree": ROOT}
        if args.baseline_rev:
            trees[args.baseline_rev] = stack.enter_context(revision(args.baseline_rev))
        got = run(trees, args.ranks, args.threads, args.seconds)
    names = list(trees)
    fig: dict[str, Any] = {"ranks": args.ranks, "threads": args.threads, **got}
    for k in names:
        fig.setdefault("added_by_job_percent", {})[k] = (
            got["job"][k]["cpu_percent"] - got["idle"][k]["cpu_percent"]
        )
    head = " | ".join(names)
    rows = [
        f"| figure (% of one core unless said) | {head} |",
        "| --- | " + " | ".join("---" for _ in names) + " |",
        "| daemon idle (the capture with no process) | "
        + " | ".join(f"{got['idle'][k]['cpu_percent']:.3f} %" for k in names)
        + " |",
        f"| daemon beside {args.ranks} ranks of {args.threads} threads | "
        + " | ".join(f"{got['job'][k]['cpu_percent']:.3f} %" for k in names)
        + " |",
        "| added by the job | "
        + " | ".join(f"{fig['added_by_job_percent'][k]:+.3f} points" for k in names)
        + " |",
        "| RSS with the job | "
        + " | ".join(f"{got['job'][k]['rss_mib']:.1f} MiB" for k in names)
        + " |",
        "| the job seen (its ranks grouped, /status) | "
        + " | ".join("yes" if got["job"][k]["job_seen"] else "no" for k in names)
        + " |",
        "| hang records of the healthy job | "
        + " | ".join(str(got["job"][k]["hangs"]) for k in names)
        + " |",
        f"| goal: at most {GOAL_PERCENT} % with the job (on the replay) | "
        + " | ".join(
            "met" if got["job"][k]["cpu_percent"] <= GOAL_PERCENT else "missed" for k in names
        )
        + " |",
    ]
    text = json.dumps(fig, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if args.section:
        title = f"## The daemon's CPU beside an {args.ranks}-rank job, on the replay"
        update_section(args.section, f"{title} ({args.section})\n\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
