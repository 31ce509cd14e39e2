#!/usr/bin/env python3
"""Does another NVML client on the node kill a running daemon? (issue 20, "never die silently")

On a 2x H100 test machine the daemon died of SIGSEGV inside libnvidia-ml about 12 s after it
started, while `gpuwatchd record` (a second process polling NVML, GPM included) was running
beside it. This drill starts the daemon in several configurations and, for each, runs other
NVML clients next to it one after the other: `gpuwatchd record`, `gpuwatchd check`, a bare
GPM sampler and a bare NVML client without GPM. After each client it checks that the daemon
is still alive and collects new `segfault` lines from the kernel log. Prints one JSON object:

    python3 tests/gpu/nvml_crash_drill.py [--variants default,no_gpm,no_xid_events] [--out FILE]

Every wait is bounded; every process started here is stopped here.
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

ROOT = Path(__file__).resolve().parent.parent.parent
PY = sys.executable

VARIANTS: dict[str, str] = {
    "default": "",
    "no_gpm": "sources:\n  nvml:\n    gpm: false\n",
    "no_xid_events": "sources:\n  nvml:\n    xid_events: false\n",
    "fast_poll": "sources:\n  nvml:\n    interval: 1.0\n",
    # the daemon as it was before GPM calls took turns: does overlap alone kill it?
    "gpm_unserialized": "",
    "gpm_unserialized_fast": "sources:\n  nvml:\n    interval: 1.0\n",
}

# Runs `gpuwatchd ARGS` with the GPM turn lock replaced by one that never waits, so the
# per-GPU workers call GPM at the same time again (drill only; the daemon has no such knob).
UNSERIALIZED = r"""
import runpy, sys
import gpuwatchd.sources.nvml.structured as structured
class NoTurn:
    def acquire(self, timeout=-1.0): return True
    def release(self): pass
structured.GPM_TURN = NoTurn()
sys.argv = ["gpuwatchd", *sys.argv[1:]]
runpy.run_module("gpuwatchd", run_name="__main__", alter_sys=True)
"""

GPM_CLIENT = r"""
import time, pynvml as nv
nv.nvmlInit()
for i in range(nv.nvmlDeviceGetCount()):
    h = nv.nvmlDeviceGetHandleByIndex(i)
    a, b = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
    nv.nvmlGpmSampleGet(h, a); time.sleep(0.5); nv.nvmlGpmSampleGet(h, b)
    r = nv.c_nvmlGpmMetricsGet_t(); r.version = nv.NVML_GPM_METRICS_GET_VERSION
    r.numMetrics = 1; r.sample1 = a; r.sample2 = b; r.metrics[0].metricId = 2
    nv.nvmlGpmMetricsGet(r); print("gpu", i, "sm_active", r.metrics[0].value)
    nv.nvmlGpmSampleFree(a); nv.nvmlGpmSampleFree(b)
nv.nvmlShutdown()
"""

PLAIN_CLIENT = r"""
import pynvml as nv
nv.nvmlInit()
for i in range(nv.nvmlDeviceGetCount()):
    h = nv.nvmlDeviceGetHandleByIndex(i)
    print(i, nv.nvmlDeviceGetName(h), nv.nvmlDeviceGetUtilizationRates(h).gpu)
nv.nvmlShutdown()
"""


def kernel_segfaults() -> list[str]:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.splitlines() if "segfault" in line or "traps:" in line]


def alive(proc: subprocess.Popen[bytes], url: str) -> bool:
    if proc.poll() is not None:
        return False
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=3) as r:
            return bool(r.status in (200, 503))
    except OSError as exc:
        return "503" in str(exc)


def start_daemon(variant: str, work: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    cfg = work / f"{variant}.yaml"
    cfg.write_text(VARIANTS[variant] or "{}\n")
    state = work / f"state-{variant}"
    log = open(work / f"daemon-{variant}.log", "wb")  # noqa: SIM115 - closed with the process
    entry = ["-c", UNSERIALIZED] if variant.startswith("gpm_unserialized") else ["-m", "gpuwatchd"]
    proc = subprocess.Popen(
        [
            PY,
            *entry,
            "run",
            "--config",
            str(cfg),
            "--state-dir",
            str(state),
            "--listen",
            f"127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(60):
        if alive(proc, url):
            break
        time.sleep(0.5)
    return proc, url


def clients(work: Path) -> list[tuple[str, list[str]]]:
    rec = [
        PY,
        "-m",
        "gpuwatchd",
        "record",
        "--out",
        str(work / "rec.json"),
        "--polls",
        "3",
        "--interval",
        "1",
    ]
    check = [PY, "-m", "gpuwatchd", "check", "--json", "--state-dir", str(work / "check-state")]
    return [
        ("record", rec),
        ("record", rec),
        ("check", check),
        ("check", check),
        ("gpm_client", [PY, "-c", GPM_CLIENT]),
        ("gpm_client", [PY, "-c", GPM_CLIENT]),
        ("plain_client", [PY, "-c", PLAIN_CLIENT]),
        ("plain_client", [PY, "-c", PLAIN_CLIENT]),
    ]


def drill(variant: str, work: Path, port: int, warm: float) -> dict[str, Any]:
    before = set(kernel_segfaults())
    proc, url = start_daemon(variant, work, port)
    t0 = time.monotonic()
    steps: list[dict[str, Any]] = []
    try:
        time.sleep(warm)
        steps.append({"step": f"warm {warm:.0f}s", "alive": alive(proc, url)})
        for name, cmd in clients(work):
            if not steps[-1]["alive"]:
                break
            started = time.monotonic() - t0
            try:
                r = subprocess.run(cmd, capture_output=True, timeout=60, cwd=ROOT)
                rc: int | str = r.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            time.sleep(3)  # the daemon's next GPM sample and poll
            steps.append(
                {"step": name, "at_s": round(started, 1), "rc": rc, "alive": alive(proc, url)}
            )
        died = proc.poll()
    finally:  # a drill stopped early (SIGTERM) stops its daemon too: it runs in its own session
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    new = [line for line in kernel_segfaults() if line not in before]
    log_tail = (work / f"daemon-{variant}.log").read_text(errors="replace").splitlines()[-15:]
    return {
        "variant": variant,
        "died": died is not None,
        "exit": died,
        "steps": steps,
        "segfaults": new,
        "daemon_log_tail": log_tail,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="default,no_gpm,no_xid_events", help=",".join(VARIANTS))
    ap.add_argument("--warm", type=float, default=15.0, help="seconds before the first client")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the drills' finally blocks
    results = []
    with tempfile.TemporaryDirectory(prefix="gw-crash-") as tmp:
        for n, variant in enumerate(args.variants.split(",")):
            results.append(drill(variant, Path(tmp), 10390 + n, args.warm))
            print(json.dumps(results[-1]), flush=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
