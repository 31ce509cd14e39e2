"""Cost of hang detection: the detector per poll, and one py-spy stack capture.

Per poll with 8 GPUs and 64 processes (8 jobs of 8 ranks, one GPU per rank):
the detector alone over typed inputs, and the adapter that builds those
inputs from /proc (environ, CPU time, command line) of 64 real processes
started for the run, each with --rank-threads threads as a PyTorch rank has (CUDA,
OpenMP, NCCL or gloo): beside it, in the same run, the same adapter reading each
rank's CPU time as the revisions before 2026-11-29 did (every thread's
/proc/PID/task/TID/stat summed). Then one `py-spy dump --native` of a local
Python process with four threads: wall time and py-spy's peak RSS.

    .venv/bin/python benchmarks/bench_hangs.py [--polls 300] [--section hangs]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scrape import pct  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector, HangThresholds  # noqa: E402
from gpuwatchd.sources.hangs import jobs as jobs_module  # noqa: E402
from gpuwatchd.sources.hangs import stacks  # noqa: E402
from gpuwatchd.sources.hangs.jobs import JobView, RankView, jobs_from_gpu_processes  # noqa: E402
from gpuwatchd.sources.hangs.proc import probe_jobs  # noqa: E402

GPUS, JOBS, RANKS = 8, 8, 8
SLEEPER = (
    "import sys, threading, time\n"
    "for _ in range(int(sys.argv[1]) - 1):\n"
    "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    "while True: time.sleep(3600)\n"
)
THREADS = """
import threading, time, sys
for i in range(3):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


def gpus_busy() -> list[GpuActivity]:
    return [GpuActivity(str(g), 1.0, 0.3, 600.0, 700.0, 0.9, 0.4, 0.5) for g in range(GPUS)]


def synthetic_jobs(step: int) -> list[JobView]:
    jobs = []
    for j in range(JOBS):
        ranks = tuple(
            RankView(1000 + j * RANKS + r, (str(r),), r, r, RANKS, cpu_seconds=step * 0.9)
            for r in range(RANKS)
        )
        jobs.append(JobView(f"slurm:{j}", ranks, RANKS, RANKS))
    return jobs


def detector_cpu(polls: int) -> list[float]:
    det = HangDetector(HangThresholds())
    gpus = gpus_busy()
    out = []
    for i in range(polls):
        jobs = synthetic_jobs(i)
        t0 = time.process_time()
        det.observe(jobs, gpus, 1000.0 + i)
        out.append(time.process_time() - t0)
    return out


def adapter_cpu(polls: int, threads: int) -> tuple[list[float], list[float], list[float]]:
    """Build the jobs from /proc of 64 real processes, then run the detector (and the
    same with every thread's stat summed, as before); and the hang path's own probe
    (every 3 s: liveness, CPU, I/O, children) with the detector."""
    procs = []
    for j in range(JOBS):
        for r in range(RANKS):
            env = {**os.environ, "SLURM_JOB_ID": str(9000 + j), "RANK": str(r)}
            env.update(LOCAL_RANK=str(r), WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS))
            cmd = [sys.executable, "-c", SLEEPER, str(threads)]
            procs.append(subprocess.Popen(cmd, env=env))
    try:
        time.sleep(1.0)
        gpu_pids = {
            str(g): [p.pid for k, p in enumerate(procs) if k % RANKS == g] for g in range(GPUS)
        }
        det = HangDetector(HangThresholds())
        gpus = gpus_busy()
        out, probes = [], []
        for i in range(polls):
            t0 = time.process_time()
            jobs = jobs_from_gpu_processes(gpu_pids)
            det.observe(jobs, gpus, 1000.0 + i)
            out.append(time.process_time() - t0)
        assert len(jobs) == JOBS and all(len(j.ranks) == RANKS for j in jobs)
        before = []
        one_read = jobs_module.read_cpu_seconds
        jobs_module.read_cpu_seconds = jobs_module._tasks_cpu_seconds  # the old way
        try:
            for i in range(polls):
                t0 = time.process_time()
                det.observe(jobs_from_gpu_processes(gpu_pids), gpus, 1500.0 + i)
                before.append(time.process_time() - t0)
        finally:
            jobs_module.read_cpu_seconds = one_read
        for i in range(polls):
            t0 = time.process_time()
            probed = probe_jobs(jobs)
            det.observe(probed, None, 2000.0 + 3 * i)
            probes.append(time.process_time() - t0)
        assert all(r.alive and r.io_bytes is not None for j in probed for r in j.ranks)
        return out, before, probes
    finally:
        for p in procs:
            p.kill()
            p.wait()


def capture_once() -> tuple[float, int, int]:
    """(seconds, py-spy peak RSS bytes, threads seen) for one dump."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    cmd = [sys.executable, "-c", THREADS]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as p:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        time.sleep(0.3)
        cap = stacks.capture(p.pid, timeout=30)
        p.kill()
    if not cap.ok:
        raise SystemExit(f"py-spy: {cap.error}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return cap.seconds, max(rss, before) * 1024, len(cap.threads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--polls", type=int, default=300)
    ap.add_argument("--section", default="", help="write this section of docs/benchmarks.md")
    ap.add_argument("--json", default="")
    ap.add_argument("--rank-threads", type=int, default=64, help="threads of each rank")
    args = ap.parse_args()
    det = detector_cpu(args.polls)
    full, before, probe = adapter_cpu(max(20, args.polls // 5), args.rank_threads)
    captures = [capture_once() for _ in range(3)]
    secs = [c[0] for c in captures]
    fig: dict[str, object] = {
        "gpus": GPUS,
        "processes": JOBS * RANKS,
        "detector_cpu_ms_per_poll_p50": pct(det, 0.5) * 1e3,
        "detector_cpu_ms_per_poll_mean": statistics.fmean(det) * 1e3,
        "rank_threads": args.rank_threads,
        "adapter_and_detector_cpu_ms_per_poll_p50": pct(full, 0.5) * 1e3,
        "adapter_summing_threads_cpu_ms_per_poll_p50": pct(before, 0.5) * 1e3,
        "probe_and_detector_cpu_ms_per_probe_p50": pct(probe, 0.5) * 1e3,
        "stack_capture_seconds_median": statistics.median(secs),
        "stack_capture_py_spy_peak_rss_mib": max(c[1] for c in captures) / 2**20,
        "stack_capture_threads": captures[0][2],
    }
    rows = [
        f"| detector CPU per poll, {GPUS} GPUs, {JOBS * RANKS} processes (p50 of {args.polls}) | "
        f"{fig['detector_cpu_ms_per_poll_p50']:.2f} ms |",
        f"| the same plus building the jobs from /proc of 64 real processes of "
        f"{args.rank_threads} threads each (p50) | "
        f"{fig['adapter_and_detector_cpu_ms_per_poll_p50']:.1f} ms |",
        "| ... reading each rank's CPU time from every thread's stat, as before (p50) | "
        f"{fig['adapter_summing_threads_cpu_ms_per_poll_p50']:.1f} ms "
        f"({pct(before, 0.5) / pct(full, 0.5):.1f}x) |",
        "| the hang path's probe (/proc stat, io, children) of the 64 plus the detector, every"
        f" 3 s (p50) | {fig['probe_and_detector_cpu_ms_per_probe_p50']:.1f} ms |",
        "| one `py-spy dump --native` of a 4-thread Python process (median of 3) | "
        f"{fig['stack_capture_seconds_median'] * 1e3:.0f} ms |",
        f"| py-spy peak RSS | {fig['stack_capture_py_spy_peak_rss_mib']:.0f} MiB |",
    ]
    publish(fig, "Hang detection cost", rows, args.section, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
