"""The slowdown run's harness: the daemon beside a one-rank job made slower by extra work.

Starts the daemon (real NVML, or a replayed capture with --dry-run) with its NVML poll
every --interval seconds, runs tests/gpu/slowdown_job.py, and every --scrape seconds
keeps the job's GPU's series from /metrics (utilization, SM and tensor activity, SM
clock, power, clock event reasons, PCIe link, the daemon's gpuwatchd_job_* series) in
OUT/metrics.jsonl and /status's slowdowns and health in OUT/status.jsonl. At the end
OUT/summary.json holds, per phase: the job's mean step time and its ratio to the
baseline, the GPU's mean SM activity, utilization and SM clock, and the SM activity
the detector's model predicts (a compute share f made (1 + s) longer reads
f (1 + s) / (1 + f s)). Exit 0 when every phase has steps and scrapes and the SM
activity moved the way the model says (within --tolerance; not judged in a dry run, whose
replayed NVML does not follow the job), 1 otherwise, 2 without a GPU.

    python3 tests/gpu/slowdown_watch.py OUT [--dry-run] [--phases ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu: its sibling scripts
from cause_kills import start_daemon  # noqa: E402
from hang_daemon_e2e import free_port, get, no_gpu  # noqa: E402
from slowdown_job import PHASES, parse_phases  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REPLAYED_CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x4-load-record.json"
KEEP = (
    "gpuwatchd_gpu_utilization_ratio",
    "gpuwatchd_gpu_sm_active_ratio",
    "gpuwatchd_gpu_sm_occupancy_ratio",
    "gpuwatchd_gpu_pipe_active_ratio",
    "gpuwatchd_gpu_clock_hertz",
    "gpuwatchd_gpu_power_watts",
    "gpuwatchd_gpu_clock_event_active",
    "gpuwatchd_gpu_pcie_link_width",
    "gpuwatchd_gpu_temperature_celsius",
    "gpuwatchd_job_",
)


def gpu_series(text: str, gpu: str) -> dict[str, float]:
    """The kept series of `gpu` (and the job series) from one exposition, by name{labels}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(KEEP):
            continue
        key, _, value = line.rpartition(" ")
        if key.startswith("gpuwatchd_gpu_") and f'gpu="{gpu}"' not in key:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def series(row: dict[str, float], name: str, **labels: str) -> float | None:
    for key, value in row.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return None


def summarize(out: Path, gpu: str, tolerance: float, dry_run: bool) -> dict[str, Any]:
    phases = [json.loads(x) for x in (out / "phases.jsonl").read_text().splitlines()]
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x]
    scrapes = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rows: dict[str, dict[str, Any]] = {}
    for i, ph in enumerate(phases):
        start = ph["t"] + min(10.0, ph["seconds"] / 3)  # the daemon's first poll of the phase
        end = phases[i + 1]["t"] if i + 1 < len(phases) else float("inf")
        times = [s["s"] for s in steps if s["phase"] == ph["phase"]]
        got = [s["series"] for s in scrapes if start <= s["t"] < end]
        sm = [v for v in (series(g, "gpuwatchd_gpu_sm_active_ratio") for g in got) if v is not None]
        util = [
            v
            for v in (series(g, "gpuwatchd_gpu_utilization_ratio", engine="gpu") for g in got)
            if v is not None
        ]
        clock = [v for v in (series(g, "gpuwatchd_gpu_clock_hertz", clock="sm") for g in got) if v]
        rows[ph["phase"]] = {
            "extra": ph["extra"],
            "steps": len(times),
            "step_s_mean": statistics.fmean(times) if times else None,
            "scrapes": len(got),
            "sm_active_mean": statistics.fmean(sm) if sm else None,
            "utilization_mean": statistics.fmean(util) if util else None,
            "sm_clock_hz_mean": statistics.fmean(clock) if clock else None,
        }
    base = rows.get("base", {})
    ok = all(r["steps"] and r["scrapes"] for r in rows.values())
    checks: dict[str, Any] = {}
    if base.get("step_s_mean") and base.get("sm_active_mean"):
        f = base["sm_active_mean"]  # the compute share of the step, as GPM reads it
        for name, r in rows.items():
            if not r["step_s_mean"] or r["sm_active_mean"] is None:
                continue
            s = r["extra"]
            r["step_ratio"] = r["step_s_mean"] / base["step_s_mean"]
            r["sm_active_predicted"] = f * (1 + s) / (1 + f * s)
            r["sm_active_error"] = r["sm_active_mean"] / r["sm_active_predicted"] - 1
            checks[name] = abs(r["sm_active_error"]) <= tolerance
        ok = ok and (dry_run or all(checks.values()))  # a replay does not follow the job
    else:
        ok = ok and dry_run
    return {"phases": rows, "within_tolerance": checks, "tolerance": tolerance, "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--phases", default=PHASES)
    ap.add_argument("--interval", type=float, default=2.0, help="the daemon's NVML poll")
    ap.add_argument("--scrape", type=float, default=2.0)
    ap.add_argument("--gpu", default="0", help="NVML index of the job's GPU")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--dry-run", action="store_true", help="replayed NVML, no CUDA")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    problem = "" if args.dry_run else no_gpu()
    if problem:
        print(json.dumps({"ok": False, "error": problem}))
        return 2
    total = sum(s for _, _, s in parse_phases(args.phases))
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        nvml = f"sources: {{nvml: {{interval: {args.interval}}}}}\n"
        daemon = start_daemon(Path(tmp), port, args.dry_run, nvml, REPLAYED_CAPTURE)
        cmd = [sys.executable, str(Path(__file__).with_name("slowdown_job.py")), str(out)]
        cmd += ["--phases", args.phases] + (["--dry-run"] if args.dry_run else [])
        with open(out / "job.log", "wb") as log:
            job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        metrics = (out / "metrics.jsonl").open("w")
        status = (out / "status.jsonl").open("w")
        deadline = time.time() + total + 120.0
        try:
            while job.poll() is None and time.time() < deadline:
                t = time.time()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        text = r.read().decode()
                    metrics.write(json.dumps({"t": t, "series": gpu_series(text, args.gpu)}) + "\n")
                    doc = get(port, "/status")
                    keep = {k: doc.get(k) for k in ("slowdowns", "health")}
                    status.write(json.dumps({"t": t, **keep}) + "\n")
                except (OSError, ValueError) as exc:
                    status.write(json.dumps({"t": t, "error": str(exc)}) + "\n")
                time.sleep(max(0.0, args.scrape - (time.time() - t)))
        finally:
            metrics.close()
            status.close()
            if job.poll() is None:
                job.kill()
            job.wait()
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
            (out / "daemon.log").write_bytes((Path(tmp) / "daemon.log").read_bytes())
    result = summarize(out, args.gpu, args.tolerance, args.dry_run)
    result.update(job_exit=job.returncode, daemon_exit=daemon.returncode, dry_run=args.dry_run)
    result["ok"] = bool(result["ok"] and job.returncode == 0)
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
