#!/usr/bin/env python3
"""Every `gpuwatchd diag` tier on this machine's GPUs, plus its failure and cancel paths.

Run from the repository root on a GPU node with PyTorch and/or CuPy in the
interpreter (root not needed):

    python3 tests/gpu/diag_tiers.py --out DIR

Runs quick and standard with each GPU library found, the dcgm tier (UNKNOWN
without DCGM), quick with a floor no GPU reaches (must exit 2), and standard
with a CUDA process started on GPU 0 a few seconds in (must be cancelled:
exit 3, no failed result, the worker gone within seconds). Writes each
report as DIR/<name>.json and prints one JSON summary; exit 0 when every
step gave the expected exit status. About 1-2 minutes on 4x H100.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
BUSY = (
    "import time, sys\n"
    "try:\n    import torch; x = torch.ones(1, device='cuda:0'); torch.cuda.synchronize()\n"
    "except ImportError:\n    import cupy; x = cupy.ones(1); cupy.cuda.Device(0).synchronize()\n"
    "print('busy', time.time(), flush=True); time.sleep(15)\n"
)


def diag(out: Path, name: str, *args: str, busy_after: float | None = None) -> dict[str, Any]:
    """Run `gpuwatchd diag ARGS --json`; keep its report as OUT/NAME.json."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "diag", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    hog = None
    if busy_after is not None:
        time.sleep(busy_after)
        hog = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.DEVNULL)
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - t0
    if hog is not None:
        hog.kill()
        hog.wait()
    (out / f"{name}.json").write_text(stdout)
    try:
        report = json.loads(stdout)
    except ValueError:
        return {
            "name": name,
            "rc": proc.returncode,
            "wall_s": round(wall, 1),
            "stderr": stderr[-2000:],
        }
    figures: dict[str, list[float]] = {}
    for r in report["results"]:
        if r["measured"] is not None:
            figures.setdefault(r["check"], []).append(round(r["measured"], 1))
    return {
        "name": name,
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "verdict": report["verdict"],
        "backend": report["backend"],
        "cancelled": report["cancelled"],
        "freed_s": round(report["freed_seconds"], 2),
        "error": report["error"],
        "failed": [f"{r['check']}:{r['gpu']}" for r in report["results"] if r["outcome"] == "fail"],
        "errors": [
            f"{r['check']}:{r['gpu']}" for r in report["results"] if r["outcome"] == "error"
        ],
        "min": {k: min(v) for k, v in figures.items()},
        "max": {k: max(v) for k, v in figures.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="diag-results")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    (out / "gpus.txt").write_text(smi + "\n" + topo)
    libs = [m for m in ("torch", "cupy") if importlib.util.find_spec(m) is not None]
    steps: list[tuple[dict[str, Any], int]] = []
    for lib in libs:
        for tier in ("quick", "standard"):
            steps.append((diag(out, f"{tier}-{lib}", "--tier", tier, "--backend", lib), 0))
    steps.append((diag(out, "dcgm", "--tier", "dcgm"), 3 if "dcgmi" not in _path() else 0))
    floors = str(ROOT / "tests/gpu/diag-floors-unreachable.yaml")
    steps.append((diag(out, "floor-above-reach", "--tier", "quick", "--floors", floors), 2))
    steps.append((diag(out, "cancel-mid-run", "--tier", "standard", busy_after=3.0), 3))
    ok = all(s["rc"] == want for s, want in steps)
    cancel = steps[-1][0]
    ok = ok and bool(cancel.get("cancelled")) and not cancel.get("failed")
    print(
        json.dumps(
            {
                "gpus": smi.strip().splitlines(),
                "ok": ok,
                "steps": [dict(s, expected_rc=w) for s, w in steps],
            },
            indent=1,
        )
    )
    return 0 if ok else 1


def _path() -> str:
    import shutil

    return "dcgmi" if shutil.which("dcgmi") else ""


if __name__ == "__main__":
    sys.exit(main())
