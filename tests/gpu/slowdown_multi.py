"""The multi-GPU slowdown run's harness (issue 32): one rank of an N-rank NCCL job slowed.

Starts `gpuwatchd run` on its defaults (real NVML polled every 10 s; only the listen
address and the state directory are set), then an N-rank torch.distributed NCCL job
(tests/gpu/slowdown_multi_rank.py, one process per GPU with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, NCCL_RAS_ADDR and
NCCL_NVLS_ENABLE=0; CUDA_DEVICE_ORDER=PCI_BUS_ID, so rank R's GPU is NVML index R).
Phases: warm, base (long enough for the detector's minute of grace and five minutes of
learning the job's balance), then per --extra value the slow rank does that share more
matmuls per step (slowNN) and then none (back), then --cost-windows pairs of windows with
the daemon stopped (daemon_offK) and running again (daemon_onK) for its cost to the job.
Every --scrape seconds OUT/polls.jsonl gets /alerts (JobSlowedByGpu firing: gpu, cause,
description), /status's `slowdowns` and /metrics' gpuwatchd_job_* series and every GPU's
SM activity and utilization. OUT/summary.json (see summarize) holds per phase the job's
step rate against base, the seconds to the first JobSlowedByGpu naming the slow rank's
GPU, false alerts, the alert's estimate against the measured step ratio and the daemon's
cost. Exit 0 when the goals hold (a dry run: when the plumbing worked), 1 otherwise,
2 without GPUs.

    python3 tests/gpu/slowdown_multi.py OUT [--ranks N] [--slow-rank R] [--extra 0.1,0.3]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu: its sibling scripts
from hang_daemon_e2e import free_port, get, no_gpu  # noqa: E402
from slowdown_multi_summary import ALERTNAME, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RANK = Path(__file__).with_name("slowdown_multi_rank.py")
REPLAYED_CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x4-load-record.json"
KEEP = ("gpuwatchd_job_", "gpuwatchd_gpu_sm_active_ratio", "gpuwatchd_gpu_utilization_ratio")


def phase_list(args: argparse.Namespace) -> str:
    """name:extra:seconds,... for the ranks (the extra applies to the slow rank only)."""
    parts = [f"warm:0:{args.warm}", f"base:0:{args.base}"]
    for i, extra in enumerate(float(x) for x in args.extra.split(",")):
        parts.append(f"slow{round(extra * 100)}:{extra}:{args.slow}")
        parts.append(f"back{i + 1 if i else ''}:0:{args.back}")
    for k in range(1, args.cost_windows + 1):
        parts += [f"daemon_off{k}:0:{args.cost}", f"daemon_on{k}:0:{args.cost}"]
    return ",".join(parts)


class Daemon:
    """`gpuwatchd run` on its defaults, stopped and started again for the cost windows."""

    def __init__(self, tmp: Path, port: int, dry_run: bool) -> None:
        self.tmp, self.port, self.dry_run = tmp, port, dry_run
        self.proc: subprocess.Popen[bytes] | None = None
        self.exits: list[int | None] = []

    def config(self) -> Path:
        """The same state directory at each start as a restarted daemon has; a dry run gives
        each start its own (on a used one the daemon takes some 10 s more to start, and
        answers SIGTERM only after: seconds a dry run has not got)."""
        state = self.tmp / (f"state{len(self.exits)}" if self.dry_run else "state")
        text = f"daemon: {{state_dir: {state}}}\n"
        if self.dry_run:  # the replay's polls quicker, so short phases see several
            text += "sources: {nvml: {interval: 0.5}}\n"
        path = self.tmp / "config.yaml"
        path.write_text(text)
        return path

    def start(self, wait: bool) -> bool:
        """Start it; with `wait`, until /healthz answers (False if it never does)."""
        cmd = [sys.executable, "-m", "gpuwatchd", "run", "--config", str(self.config())]
        cmd += ["--listen", f"127.0.0.1:{self.port}"]
        if self.dry_run:
            cmd += ["--nvml-replay", str(REPLAYED_CAPTURE)]
        with open(self.tmp / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        for _ in range(240 if wait else 0):
            if self.up():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.25)
        return not wait

    def up(self) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.exits.append(self.proc.returncode)
        self.proc = None


def poll(port: int) -> dict[str, Any]:
    """One look at the daemon: firing JobSlowedByGpu alerts, /status slowdowns, series."""
    firing = get(port, "/alerts?state=firing").get("alerts", [])
    alerts = [
        {
            "gpu": a["labels"].get("gpu"),
            "cause": a["labels"].get("cause"),
            "job": a["labels"].get("job"),
            "startsAt": a.get("startsAt"),
            "description": a.get("annotations", {}).get("description", ""),
        }
        for a in firing
        if a.get("labels", {}).get("alertname") == ALERTNAME
    ]
    slowdowns = get(port, "/status").get("slowdowns", {})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    series: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(KEEP):
            key, _, value = line.rpartition(" ")
            try:
                series[key] = float(value)
            except ValueError:
                continue
    return {"alerts": alerts, "slowdowns": slowdowns, "series": series}


def rank_env(rank: int, ranks: int, master_port: int, ras_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        NCCL_RAS_ADDR=f"127.0.0.1:{ras_port}",
        NCCL_NVLS_ENABLE="0",  # NVLink multicast off (as nccl_rank.py's MULTICAST_OFF)
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        OMP_NUM_THREADS="2",
        CUDA_DEVICE_ORDER="PCI_BUS_ID",  # CUDA ordinals in NVML's order: rank R on GPU R
        PYTHONUNBUFFERED="1",
    )
    return env


def gpu_count() -> int:
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def run(args: argparse.Namespace, out: Path, tmp: Path) -> dict[str, Any]:
    phases = phase_list(args)
    total = sum(float(p.split(":")[2]) for p in phases.split(","))
    daemon = Daemon(tmp, free_port(), args.dry_run)
    started = daemon.start(wait=True)
    if not started:
        daemon.stop()
        (out / "daemon.log").write_bytes((tmp / "daemon.log").read_bytes())
        return {"ok": False, "error": "the daemon did not start (OUT/daemon.log)"}
    master, ras = free_port(), free_port()
    ranks: list[subprocess.Popen[bytes]] = []
    polls = (out / "polls.jsonl").open("w")
    (out / "phases.jsonl").write_text("")
    seen = 0
    phase = ""
    try:
        for r in range(args.ranks):
            cmd = [sys.executable, str(RANK), str(out), "--phases", phases]
            cmd += ["--slow-rank", str(args.slow_rank), "--matmuls", str(args.matmuls)]
            cmd += ["--dry-run"] if args.dry_run else []
            with open(out / f"rank{r}.log", "wb") as log:
                env = rank_env(r, args.ranks, master, ras)
                ranks.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + total + args.startup
        while any(p.poll() is None for p in ranks) and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p in ranks):
                break  # a rank failed: the others would wait in their all_reduce for ever
            t = time.time()
            marks = (out / "phases.jsonl").read_text().splitlines()
            if len(marks) > seen:
                seen = len(marks)
                phase = json.loads(marks[-1])["phase"]
                if phase.startswith("daemon_off") and daemon.proc is not None:
                    daemon.stop()
                elif not phase.startswith("daemon_off") and daemon.proc is None:
                    daemon.start(wait=False)  # polls fail until it serves: the loop goes on
            row: dict[str, Any] = {"t": t, "phase": phase, "daemon": daemon.proc is not None}
            if daemon.proc is not None and daemon.proc.poll() is not None:
                row["error"], started = f"daemon exited {daemon.proc.returncode}", False
            elif daemon.proc is not None:
                try:
                    row.update(poll(daemon.port))
                except (OSError, ValueError, KeyError) as exc:
                    row["error"] = str(exc)
            polls.write(json.dumps(row) + "\n")
            polls.flush()
            time.sleep(max(0.0, args.scrape - (time.time() - t)))
    finally:
        polls.close()
        for p in ranks:
            if p.poll() is None:
                p.terminate()
        for p in ranks:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        daemon.stop()
        (out / "daemon.log").write_bytes((tmp / "daemon.log").read_bytes())
    result = summarize(out, args)
    result.update(
        rank_exits=[p.returncode for p in ranks],
        daemon_exits=daemon.exits,
        daemon_started=started,
        phases_run=phases,
    )
    plumbing = started and all(c == 0 for c in result["rank_exits"] + daemon.exits)
    result["ok"] = bool(result["ok"] and plumbing)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=0, help="default: every GPU (4 in a dry run)")
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--extra", default="0.1", help="the slow rank's extra work, e.g. 0.1,0.3")
    ap.add_argument("--warm", type=float, default=30.0)
    ap.add_argument("--base", type=float, default=420.0, help="covers grace and learning")
    ap.add_argument("--slow", type=float, default=180.0)
    ap.add_argument("--back", type=float, default=180.0)
    ap.add_argument("--cost", type=float, default=60.0, help="seconds per cost window")
    ap.add_argument("--cost-windows", type=int, default=2, help="off/on pairs (0: none)")
    ap.add_argument("--settle", type=float, default=15.0, help="steps left out per window")
    ap.add_argument("--clear", type=float, default=120.0, help="back: an alert may last this")
    ap.add_argument("--within", type=float, default=120.0, help="goal: slowdown to alert")
    ap.add_argument("--max-cost", type=float, default=0.01, help="goal: the daemon's cost")
    ap.add_argument("--matmuls", type=int, default=40)
    ap.add_argument("--scrape", type=float, default=2.0)
    ap.add_argument("--startup", type=float, default=180.0, help="for NCCL's set-up and exit")
    ap.add_argument("--dry-run", action="store_true", help="replayed NVML, sleeping ranks")
    args = ap.parse_args()
    if args.dry_run:  # short phases: the plumbing in seconds
        args.warm, args.base, args.slow, args.back = 1.0, 1.5, 1.5, 1.5
        args.cost, args.settle, args.clear, args.scrape = 2.0, 0.0, 1.0, 0.5
        args.cost_windows = min(args.cost_windows, 1)
        args.matmuls, args.startup = 10, 30.0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    problem = "" if args.dry_run else no_gpu()
    if problem:
        print(json.dumps({"ok": False, "error": problem}))
        return 2
    if not args.ranks:
        args.ranks = 4 if args.dry_run else gpu_count()
    if not 0 <= args.slow_rank < args.ranks or args.ranks < 2:
        print(json.dumps({"ok": False, "error": f"--slow-rank {args.slow_rank} of {args.ranks}"}))
        return 1
    # SIGTERM (a timeout) unwinds like Ctrl-C: the ranks and the daemon are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, out, Path(tmp))
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
