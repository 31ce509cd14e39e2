#!/usr/bin/env python3
"""Wall time of `gpuwatchd check` on a real GPU node, every source enabled.

Runs the real CLI in a fresh process each time, as a Slurm prolog does (bytecode
compiled as pip installs it; the first run without is timed apart), with the
default config (NVML, /dev/kmsg, shm, InfiniBand, workloads) and a fresh state
dir, in the four ways users call it (text, `--json`, `--format npd`,
`--timeout 2`), and beside it the floor every Python NVML check pays (`import
pynvml; nvmlInit()`). One extra run under cProfile names where the time goes.

    python3 tests/gpu/check_timing.py [--runs 8] [--out result.json]

Prints one JSON object; exit status 0 when the median of every way is under
--target seconds (default 1.0), 1 when not, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
WAYS = {
    "text": [],
    "--json": ["--json"],
    "--format npd": ["--format", "npd"],
    "--timeout 2": ["--timeout", "2"],
}
FLOOR = "import pynvml; pynvml.nvmlInit(); pynvml.nvmlShutdown()"


def timed(argv: list[str]) -> tuple[float, int, str]:
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return time.monotonic() - t0, proc.returncode, proc.stdout[-400:] + proc.stderr[-400:]


def profile(state: str) -> str:
    """The top of a cProfile of one check, in-process (cumulative time)."""
    sys.path.insert(0, str(ROOT))
    from gpuwatchd.cli import main as cli_main

    prof = cProfile.Profile()
    prof.enable()
    try:
        cli_main(["check", "--state-dir", state, "--json"])
    finally:
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()[-6000:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--target", type=float, default=1.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    floor_s, floor_rc, floor_out = timed([sys.executable, "-c", FLOOR])
    if floor_rc != 0:
        print(json.dumps({"error": "no GPU", "detail": floor_out}))
        return 2
    state = tempfile.mkdtemp(prefix="check-timing-")
    result: dict[str, object] = {}
    # The first run compiles every module (a fresh checkout, or an interpreter that
    # writes no bytecode); an installed package has its .pyc from pip. Time that first
    # run alone, then compile as pip would and time the rest.
    first, _, _ = timed([sys.executable, "-m", "gpuwatchd", "check", "--state-dir", state])
    result["first run, no bytecode"] = {"wall_s": round(first, 3)}
    where = [str(ROOT / "gpuwatchd"), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *where], check=False)
    ok = True
    for way, extra in WAYS.items():
        walls, codes = [], []
        for _ in range(args.runs):
            wall, rc, tail = timed(
                [sys.executable, "-m", "gpuwatchd", "check", "--state-dir", state, *extra]
            )
            walls.append(wall)
            codes.append(rc)
        p50 = statistics.median(walls)
        ok = ok and p50 < args.target
        result[way] = {
            "wall_p50_s": round(p50, 3),
            "wall_max_s": round(max(walls), 3),
            "exit_codes": sorted(set(codes)),
            "last_output_tail": tail,
        }
    floors = [timed([sys.executable, "-c", FLOOR])[0] for _ in range(args.runs)]
    result["floor: import pynvml; nvmlInit()"] = {"wall_p50_s": round(statistics.median(floors), 3)}
    result["target_s"] = args.target
    result["profile_top"] = profile(state)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
