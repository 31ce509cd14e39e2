#!/usr/bin/env python3
"""Where a bare pynvml process's resident memory comes from, started several ways at once.

The footprint benchmark compares the daemon with a "floor": a Python that imports
pynvml, calls nvmlInit() and sleeps. On one real H200 that floor read 50.6 MiB
when the benchmark started it and 41.0 MiB when the same one-liner was started by
hand beside the daemon. This starts the one-liner in each way, 0.5 s apart,
waits, and prints each copy's RSS, its largest mappings, where pynvml and
libnvidia-ml came from and what differed in its start (working directory,
environment, interpreter flags):

    python3 tests/gpu/floor_probe.py [--seconds 60] [--out result.json]

Exit status 0 when NVML initialised in every copy, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_footprint import rss_by_mapping  # noqa: E402

# Each copy reports what it loaded, then sleeps like the floor.
REPORT = (
    "import json, sys, pynvml\n"
    "ok = True\n"
    "try:\n"
    "    pynvml.nvmlInit()\n"
    "except pynvml.NVMLError:\n"
    "    ok = False\n"
    "print(json.dumps({'pynvml': pynvml.__file__, 'nvml_ok': ok, 'path': sys.path}), flush=True)\n"
)


# glibc keeps freed heap unless the free chunk ends up at the top: give it back, as the
# daemon does once it serves (malloc_trim), to see what the process really holds.
TRIM = "import ctypes\nctypes.CDLL('libc.so.6').malloc_trim(0)\n"


def variants(tmp: str) -> dict[str, tuple[list[str], str, dict[str, str], str]]:
    """name -> (argv, cwd, env, code after nvmlInit): the benchmark's way, the ways a
    person starts it, the same way three times (is it stable?), and trimmed."""
    env = dict(os.environ)
    clean = {k: v for k, v in env.items() if not k.startswith("PYTHON")}
    python3 = [shutil.which("python3") or sys.executable, "-c"]
    here = [sys.executable, "-c"]
    repo = str(ROOT)
    return {
        "benchmark (this interpreter, repo cwd, this env)": (here, repo, env, ""),
        "the same, again": (here, repo, env, ""),
        "the same, a third time": (here, repo, env, ""),
        "this interpreter, /tmp cwd, this env": (here, tmp, env, ""),
        "python3 on PATH, /tmp cwd, no PYTHON* env": (python3, tmp, clean, ""),
        "benchmark way + malloc_trim": (here, repo, env, TRIM),
        "benchmark way + malloc_trim, again": (here, repo, env, TRIM),
        "python3 on PATH, /tmp, no PYTHON* env + malloc_trim": (python3, tmp, clean, TRIM),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp()
    procs = {}
    for name, (cmd, cwd, env, after) in variants(tmp).items():
        code = REPORT + after + f"import time\ntime.sleep({args.seconds + 30})\n"
        procs[name] = subprocess.Popen(
            [*cmd, code], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)  # one nvmlInit at a time
    time.sleep(args.seconds)
    out: dict[str, object] = {"seconds": args.seconds}
    all_ok = True
    try:
        for name, p in procs.items():
            assert p.stdout is not None
            said = json.loads(p.stdout.readline() or "{}")
            if p.poll() is not None:  # no pynvml for this interpreter, say
                out[name] = {"error": f"exited with status {p.returncode}"}
                all_ok = False
                continue
            all_ok = all_ok and bool(said.get("nvml_ok"))
            maps = rss_by_mapping(p.pid)
            status = Path(f"/proc/{p.pid}/status").read_text()
            rss = next(
                int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")
            )
            nvml_libs = sorted({k for k in maps if "nvidia-ml" in k or "libcuda" in k})
            out[name] = {
                "rss_mib": round(rss / 1024, 1),
                "largest_mappings_mib": {
                    k: round(v, 2) for k, v in sorted(maps.items(), key=lambda kv: -kv[1])[:8]
                },
                "nvml_libraries": nvml_libs,
                **said,
            }
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all_ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
