#!/usr/bin/env python3
"""On a real GPU: the daemon's CPU while an N-rank job trains and while it hangs.

Starts `gpuwatchd run` on its defaults (only the listen address and the state
directory set; real NVML, the real kernel log) and measures its CPU (user + system
from /proc/PID/stat) over --seconds in three phases, scraping /metrics every 15 s as
Prometheus would:

1. idle: no job on the node;
2. training: an N-rank torch.distributed job (default 8), `gloo` because one GPU
   cannot hold two NCCL ranks, every rank on cuda:0 stepping as training does, with
   no pause: --matmuls bf16 matmuls of --size (the GPU busy), then an all_reduce of a
   4 MiB CPU tensor (`--light`: the ranks of tests/gpu/cause_kills.py instead, a
   512x512 matmul and a tiny all_reduce every 0.2 s, under 5 % of a core each);
3. hung: the last rank stopped with SIGSTOP, the others blocked in their all_reduce,
   the daemon's hang path (probes, verdict, alert) at work.

gloo has no NCCL RAS, so the daemon makes no RAS query there. The RAS part is measured
apart (--ras-queries, default 40): a one-rank NCCL job with its RAS service up, queried
that many times in this process by the daemon's own client (`sources/hangs/ras.py`), CPU
per query, and what one query every `ras_poll_interval_seconds` costs. Multi-GPU NVML
polls it cannot show. Run from the repository root, as root, with an NVIDIA GPU and PyTorch:

    python3 tests/gpu/job_cpu.py [--ranks 8] [--seconds 90] [--out result.json]

Prints one JSON object: per phase the daemon's CPU in % of one core, its RSS, the
/hangs records and firing JobHangSuspected alerts seen, and whether the job was seen
(gpuwatchd_job_hang_ranks or the hang record's ranks). Exit 0 when the healthy phases
raised no hang and the hung phase did, 1 otherwise, 2 without a GPU. --dry-run: fake
ranks beside the daemon on a replayed NVML capture, short phases: the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from cause_kills import firing_hang_alerts, start_daemon, wait_for  # noqa: E402
from hang_daemon_e2e import free_port, get, no_gpu  # noqa: E402
from hang_daemon_e2e import job_env as shared_job_env  # noqa: E402

from gpuwatchd.config import Config  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TICK = os.sysconf("SC_CLK_TCK")
SCRAPE_EVERY = 15.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads(pid: int) -> int:
    """Threads of `pid` now (what reading every thread's stat file cost per rank)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return len(r.read())


def phase(daemon: int, port: int, seconds: float, threads_json: str = "") -> dict[str, Any]:
    """The daemon's CPU over `seconds`, scraped every SCRAPE_EVERY s (and, with
    `threads_json`, its CPU per thread over the same time, by benchmarks/thread_cpu.py)."""
    per_thread = None
    if threads_json:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "thread_cpu.py"), "--pid", str(daemon)]
        cmd += ["--seconds", str(seconds), "--json", threads_json]
        per_thread = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0, c0 = time.monotonic(), cpu_seconds(daemon)
    scrapes = 0
    while (left := seconds - (time.monotonic() - t0)) > 0:
        try:
            scrape(port)
            scrapes += 1
        except OSError:
            pass
        time.sleep(min(SCRAPE_EVERY, max(left, 0.0)))
    wall, cpu = time.monotonic() - t0, cpu_seconds(daemon) - c0
    if per_thread is not None:
        per_thread.wait(seconds + 30)
    hangs = get(port, "/hangs").get("hangs", [])
    return {
        "seconds": round(wall, 1),
        "cpu_percent_of_one_core": round(100 * cpu / wall, 3),
        "rss_mib": round(rss_mib(daemon), 1),
        "scrapes": scrapes,
        "hangs": [f"{d.get('id')}: {d.get('reason')}" for d in hangs if not d.get("resolved_at")],
        "firing_hang_alerts": len(firing_hang_alerts(port)),
    }


def worker(run_dir: Path, size: int, matmuls: int, dry_run: bool) -> int:
    """One rank: steps of GPU matmuls and a CPU all_reduce, as fast as they go."""
    rank = int(os.environ["RANK"])
    step: Any = lambda: time.sleep(0.05)  # noqa: E731
    if not dry_run:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        a = torch.randn(size, size, device="cuda:0", dtype=torch.bfloat16)
        grads = torch.ones(1 << 20)

        def step() -> None:
            for _ in range(matmuls):
                b = a @ a
            b.sum().item()
            dist.all_reduce(grads)

    n, t0 = 0, time.monotonic()
    while True:
        step()
        n += 1
        if n == 1:
            (run_dir / f"ready-{rank}").touch()
        if n % 50 == 0:
            print(f"rank {rank} step {n} at {time.monotonic() - t0:.1f} s", flush=True)


def ras_cost(queries: int, tmp: Path, interval: float) -> dict[str, Any]:
    """CPU of the daemon's RAS client per query, against a one-rank NCCL job."""
    from gpuwatchd.sources.hangs import ras

    run_dir = tmp / "ras1"
    run_dir.mkdir()
    addr = f"localhost:{free_port()}"
    env = dict(os.environ, NCCL_RAS_ADDR=addr, MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    log = open(tmp / "ras1.log", "wb")  # noqa: SIM115
    job = subprocess.Popen(
        [sys.executable, str(HERE / "hang_jobs.py"), "ras1", str(run_dir)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    out: dict[str, Any] = {"addr": addr, "queries": queries}
    try:
        if not wait_for(time.time() + 120, lambda: (run_dir / "ready").exists()):
            out["error"] = "the NCCL job was not ready within 120 s"
            return out
        time.sleep(2)
        answers, cpu, wall, size = 0, 0.0, 0.0, 0
        for _ in range(queries):
            c0, w0 = time.process_time(), time.monotonic()
            got = ras.query(addr, timeout=10)
            cpu += time.process_time() - c0
            wall += time.monotonic() - w0
            answers += got.report is not None
            size = max(size, len(got.text))
        out.update(
            answers=answers,
            cpu_ms_per_query=round(1000 * cpu / queries, 2),
            wall_ms_per_query=round(1000 * wall / queries, 2),
            answer_bytes=size,
            poll_interval_seconds=interval,
            cpu_percent_of_one_core_per_job=round(100 * cpu / queries / interval, 4),
        )
        return out
    finally:
        (run_dir / "go-abort").touch()
        time.sleep(1)
        if job.poll() is None:
            job.kill()
        job.wait(10)


def job_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    env = shared_job_env(rank, port)
    env.update(WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    env.pop("PYTHONFAULTHANDLER", None)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=90.0, help="each phase")
    ap.add_argument("--settle", type=float, default=20.0, help="after the job starts stepping")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--size", type=int, default=8192, help="the matmuls' side")
    ap.add_argument("--matmuls", type=int, default=8, help="matmuls per step")
    ap.add_argument("--light", action="store_true", help="cause_kills.py's light ranks")
    ap.add_argument("--logs", default="", help="copy the ranks' and daemon's logs here")
    ap.add_argument("--ras-queries", type=int, default=40, help="0: no RAS measurement")
    ap.add_argument(
        "--profile", default="", help="py-spy's collapsed stacks of the daemon while training, here"
    )
    ap.add_argument(
        "--threads-out", default="", help="the daemon's CPU per thread in each phase, here"
    )
    ap.add_argument("--dry-run", action="store_true", help="fake ranks, replayed NVML")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker), args.size, args.matmuls, args.dry_run)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": args.ranks,
        "job": "light" if args.light else f"{args.matmuls} bf16 matmuls of {args.size}/step",
        "dry_run": args.dry_run,
    }
    problem = "" if args.dry_run else no_gpu()
    if problem:
        result["error"] = problem
        print(json.dumps(result, indent=1))
        return 2
    procs: list[subprocess.Popen[bytes]] = []

    def threads_json(name: str) -> str:
        if not args.threads_out:
            return ""
        Path(args.threads_out).mkdir(parents=True, exist_ok=True)
        return str(Path(args.threads_out) / f"{name}.json")

    with tempfile.TemporaryDirectory(prefix="gpuwatchd-job-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        daemon = start_daemon(tmp, port, args.dry_run)
        try:
            time.sleep(args.settle)  # past start-up: the first polls cost more
            result["idle"] = phase(daemon.pid, port, args.seconds, threads_json("idle"))
            run_dir = tmp / "job"
            run_dir.mkdir()
            master = free_port()
            if args.light:
                cmd = [sys.executable, str(HERE / "cause_kills.py"), "--rank", "-", str(run_dir)]
            else:
                cmd = [sys.executable, __file__, "--worker", str(run_dir)]
                cmd += ["--size", str(args.size), "--matmuls", str(args.matmuls)]
            cmd += ["--dry-run"] if args.dry_run else []
            for r in range(args.ranks):
                log = open(tmp / f"rank{r}.log", "wb")  # noqa: SIM115
                env = job_env(r, args.ranks, master)
                procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
                log.close()
            ready = wait_for(
                time.time() + args.start_timeout,
                lambda: all((run_dir / f"ready-{r}").exists() for r in range(args.ranks)),
            )
            if not ready:
                result["error"] = f"the ranks did not step within {args.start_timeout} s"
                return 1
            time.sleep(args.settle)
            ranks_cpu = sum(cpu_seconds(p.pid) for p in procs)
            spy = None
            if args.profile:  # sampled without pausing the daemon, in py-spy's own process
                spy = subprocess.Popen(
                    ["py-spy", "record", "--nonblocking", "-r", "50", "-f", "raw"]
                    + ["-d", str(int(args.seconds)), "-p", str(daemon.pid), "-o", args.profile],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            result["training"] = phase(daemon.pid, port, args.seconds, threads_json("training"))
            if spy is not None:
                result["profile_exit"] = spy.wait(30)
            used = sum(cpu_seconds(p.pid) for p in procs) - ranks_cpu
            result["training"]["rank_threads"] = [threads(p.pid) for p in procs]
            result["training"]["ranks_cpu_percent_of_one_core_each"] = round(
                100 * used / result["training"]["seconds"] / args.ranks, 2
            )
            os.kill(procs[-1].pid, signal.SIGSTOP)
            result["stopped_pid"] = procs[-1].pid
            result["hung"] = phase(daemon.pid, port, args.seconds)
            os.kill(procs[-1].pid, signal.SIGCONT)
            for p in procs:
                p.kill()
                p.wait(10)
            if args.ras_queries and not args.dry_run:
                interval = Config().hangs.ras_poll_interval_seconds
                result["ras"] = ras_cost(args.ras_queries, tmp, interval)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
            result["daemon_exit"] = daemon.returncode
            tail = (tmp / "daemon.log").read_text(errors="replace").splitlines()[-20:]
            result["daemon_log_tail"] = tail
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                for f in tmp.glob("*.log"):
                    (Path(args.logs) / f.name).write_bytes(f.read_bytes())
    healthy = [result.get(k, {}) for k in ("idle", "training")]
    result["ok"] = bool(
        all(h and not h["hangs"] and not h["firing_hang_alerts"] for h in healthy)
        and result.get("hung", {}).get("hangs")
    )
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
