#!/usr/bin/env python3
"""The daemon's footprint on a real GPU, beside a bare pynvml process, in one run.

Starts `gpuwatchd run` with the default config (every source at its default
interval, real NVML) and, at the same time, a bare Python that imports
pynvml, calls nvmlInit() and sleeps. After a warm-up both are watched for
--seconds (default 120) while the daemon is scraped every 15 s. Prints one
JSON object: RSS in MiB and CPU in % of one core for both, the daemon's RSS
above the floor, the ratio, and whether the targets hold (RSS at most
20 MiB above the floor, issue 23's budget with prometheus_client; CPU at most
0.3 % of a core with one GPU, issue 9's). Run from
the repository root, as root or a user that can read /dev/kmsg:

    python3 tests/gpu/footprint.py [--seconds 120] [--out result.json]

Exit status 0 when NVML has at least one GPU and both targets hold, 1 when
a target is missed, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_footprint import (  # noqa: E402
    TARGET_CPU_ONE_GPU,
    TARGET_RSS_ABOVE_FLOOR_MIB,
    measure,
)


def gpu_count() -> tuple[int, str]:
    """Number of GPUs and the driver version, from NVML; (0, reason) without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount(), str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no library, no driver: say why
        return 0, f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    gpus, driver = gpu_count()
    if gpus == 0:
        print(json.dumps({"error": "no GPU", "detail": driver}))
        return 2
    fig = measure(None, args.seconds)
    fig["gpus"] = gpus
    fig["driver"] = driver
    # The CPU target is stated for one GPU; scale it when the machine has more.
    fig["target_cpu_percent"] = round(TARGET_CPU_ONE_GPU * 100 * gpus, 2)
    fig["target_rss_above_floor_mib"] = TARGET_RSS_ABOVE_FLOOR_MIB
    fig["rss_ok"] = fig["rss_above_floor_mib"] <= TARGET_RSS_ABOVE_FLOOR_MIB
    fig["cpu_ok"] = fig["daemon_cpu_percent_of_one_core"] <= fig["target_cpu_percent"]
    text = json.dumps(fig, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if fig["rss_ok"] and fig["cpu_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
