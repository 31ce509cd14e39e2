#!/usr/bin/env python3
"""Prove the stuck-GPU detector on a real GPU: a spinning kernel is flagged, real work is not.

Three phases on one GPU, each watched through real NVML and fed to
gpuwatchd.health.stuck with a shortened duration (the power, utilisation
and memory thresholds keep their defaults):

  idle    nothing running                                   -> must not be flagged
  spin    a CUDA kernel spinning on a flag in device memory,
          as a NCCL collective waiting for a missing peer   -> must be flagged
  matmul  a real matrix-multiply load of the same length    -> must not be flagged

NVML is read through gpuwatchd's own NvmlSource when pynvml is importable
(the path the daemon uses), else through a small ctypes binding to
libnvidia-ml (both in stuck_nvml.py). The spin kernel needs CuPy (fallback: torch.cuda._sleep,
which spins on the clock instead of a flag); the load needs PyTorch
(fallback: CuPy). Run from the repository root:

    python3 tests/gpu/stuck_gpu.py [--duration 60] [--min-duration 20] [--out result.json]

Prints one JSON object; exit status 0 when all three verdicts are right.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from stuck_nvml import make_reader  # noqa: E402

from gpuwatchd.clock import SystemClock  # noqa: E402
from gpuwatchd.health.stuck import (  # noqa: E402
    StuckDetector,
    StuckThresholds,
    matches,
    proc_describer,
)
from gpuwatchd.model import Finding  # noqa: E402

SPIN_SOURCE = r"""
extern "C" __global__ void spin_until(const volatile int* flag, unsigned long long* spins) {
    unsigned long long n = 0;
    while (*flag == 0) {  // a volatile load each turn: L2, no DRAM traffic, no math
        ++n;
    }
    if (threadIdx.x == 0) atomicAdd(spins, n);
}
"""


def normalize_bus_id(bus: str) -> str:
    domain, _, rest = bus.strip().lower().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus.strip().lower()


# --- which GPU -------------------------------------------------------------------------


def cuda_bus_id() -> tuple[str, str]:
    """PCI bus id of CUDA device 0 and how it was found."""
    try:
        import cupy

        return normalize_bus_id(cupy.cuda.Device(0).pci_bus_id), "cupy"
    except Exception:
        pass
    try:
        import torch

        p = torch.cuda.get_device_properties(0)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        return bus, "torch"
    except Exception:
        return "", "none"


# --- watching a phase ------------------------------------------------------------------


class Watch:
    """Samples NVML every `interval` s on its own thread and feeds the detector."""

    def __init__(self, reader: Any, thresholds: StuckThresholds, interval: float) -> None:
        self.reader = reader
        self.thresholds = thresholds
        self.interval = interval
        self.detector = StuckDetector(thresholds, SystemClock(), describe=proc_describer())
        self.rows: list[dict[str, Any]] = []
        self.first_flag: float | None = None
        self.finding: Finding | None = None
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception as exc:  # keep watching; report what failed
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval)

    def _once(self) -> None:
        snap = self.reader.snapshot()
        r = self.reader.reading(snap)
        at = time.monotonic() - self.t0
        if snap is not None:
            findings = self.detector.evaluate(snap)
        else:
            findings = self.detector.observe([r] if r is not None else [])
        mine = [f for f in findings if r is not None and dict(f.subject).get("gpu") == r.gpu]
        if r is not None:
            self.rows.append(
                {
                    "t": round(at, 2),
                    "util": r.utilization,
                    "mem_util": r.memory_utilization,
                    "power_w": r.power_watts,
                    "limit_w": r.power_limit_watts,
                    "match": matches(r, self.thresholds),
                    "processes": list(r.processes),
                }
            )
        if mine and self.first_flag is None:
            self.first_flag, self.finding = at, mine[0]

    def summary(self) -> dict[str, Any]:
        def stats(key: str) -> dict[str, float] | None:
            vals = [row[key] for row in self.rows if row[key] is not None]
            if not vals:
                return None
            return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}

        procs = sorted({p for row in self.rows for p in row["processes"]})
        return {
            "samples": len(self.rows),
            "utilization": stats("util"),
            "memory_utilization": stats("mem_util"),
            "power_watts": stats("power_w"),
            "power_limit_watts": self.rows[-1]["limit_w"] if self.rows else None,
            "samples_matching_pattern": sum(1 for row in self.rows if row["match"]),
            "flagged": self.first_flag is not None,
            "first_flag_after_seconds": None
            if self.first_flag is None
            else round(self.first_flag, 2),
            "finding": None
            if self.finding is None
            else {
                "alertname": self.finding.alertname,
                "severity": str(self.finding.severity),
                "reason": self.finding.reason,
                "subject": dict(self.finding.subject),
            },
            "processes_seen": procs,
            "own_pid_named": any(p.split(" ", 1)[0] == str(os.getpid()) for p in procs),
            "watch_errors": self.errors[:5],
            "trace": self.rows[:: max(1, len(self.rows) // 30)],
        }


def run_phase(
    reader: Any, thresholds: StuckThresholds, interval: float, body: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    watch = Watch(reader, thresholds, interval)
    watch.start()
    t0 = time.monotonic()
    extra: dict[str, Any] = {}
    try:
        extra = body()
    except Exception as exc:
        extra = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        watch.stop()
    return {"wall_seconds": round(time.monotonic() - t0, 2), **extra, **watch.summary()}


# --- the workloads ---------------------------------------------------------------------


def idle(duration: float) -> Callable[[], dict[str, Any]]:
    def body() -> dict[str, Any]:
        time.sleep(duration)
        return {"impl": "sleep"}

    return body


def spin(duration: float, blocks: int, threads: int) -> Callable[[], dict[str, Any]]:
    def body() -> dict[str, Any]:
        try:
            import cupy
        except ImportError:
            return spin_torch(duration)
        import cupyx
        import numpy

        kernel = cupy.RawKernel(SPIN_SOURCE, "spin_until")
        flag = cupy.zeros(1, dtype=cupy.int32)
        spins = cupy.zeros(1, dtype=cupy.uint64)
        one = cupyx.empty_pinned((1,), dtype=numpy.int32)
        one[0] = 1
        run_stream = cupy.cuda.Stream(non_blocking=True)
        copy_stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.Device().synchronize()
        with run_stream:
            kernel((blocks,), (threads,), (flag, spins))
        time.sleep(duration)
        # The "peer" arrives: write the flag from another stream while the kernel runs.
        cupy.cuda.runtime.memcpyAsync(
            flag.data.ptr, one.ctypes.data, 4, cupy.cuda.runtime.memcpyHostToDevice, copy_stream.ptr
        )
        copy_stream.synchronize()
        deadline = time.monotonic() + 15
        while not run_stream.done and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = bool(run_stream.done)
        return {
            "impl": f"cupy spin on a device-memory flag, {blocks}x{threads} threads",
            "stopped_cleanly": stopped,
            "spins": int(spins.get()[0]) if stopped else None,
        }

    return body


def spin_torch(duration: float) -> dict[str, Any]:
    import torch

    # torch.cuda._sleep spins one thread on clock64(): no flag, but the same NVML picture.
    rate_khz = 1_500_000
    try:
        rate_khz = torch.cuda.get_device_properties(0).clock_rate  # type: ignore[attr-defined]
    except Exception:
        pass
    torch.cuda._sleep(int(duration * rate_khz * 1000))
    torch.cuda.synchronize()
    return {"impl": "torch.cuda._sleep (clock spin, CuPy missing)", "stopped_cleanly": True}


def matmul(duration: float, size: int) -> Callable[[], dict[str, Any]]:
    def body() -> dict[str, Any]:
        try:
            import torch

            a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            sync, impl = torch.cuda.synchronize, "torch bf16 matmul"

            def mm() -> None:
                torch.matmul(a, b)
        except ImportError:
            import cupy

            a = cupy.random.rand(size, size, dtype=cupy.float32).astype(cupy.float16)
            b = cupy.random.rand(size, size, dtype=cupy.float32).astype(cupy.float16)
            sync, impl = cupy.cuda.Device().synchronize, "cupy fp16 matmul"

            def mm() -> None:
                cupy.matmul(a, b)

        sync()
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < duration:
            for _ in range(20):
                mm()
            sync()
            n += 20
        elapsed = time.monotonic() - t0
        return {
            "impl": f"{impl}, {size}x{size}",
            "matmuls": n,
            "tflops": round(2 * size**3 * n / elapsed / 1e12, 1),
        }

    return body


# --- main ------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of spin and of matmul")
    ap.add_argument("--idle", type=float, default=15.0, help="seconds of the idle phase")
    ap.add_argument(
        "--min-duration",
        type=float,
        default=20.0,
        help="detector: how long the pattern must last (default config: 300)",
    )
    ap.add_argument("--max-gap", type=float, default=10.0, help="detector: max gap")
    ap.add_argument("--interval", type=float, default=1.0, help="NVML sampling period")
    ap.add_argument("--blocks", type=int, default=32, help="spin kernel blocks (NCCL channels)")
    ap.add_argument("--threads", type=int, default=128, help="spin kernel threads per block")
    ap.add_argument("--size", type=int, default=8192, help="matmul size")
    ap.add_argument("--ctypes", action="store_true", help="read NVML via ctypes, not gpuwatchd")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()

    thresholds = StuckThresholds(
        min_duration_seconds=args.min_duration, max_gap_seconds=args.max_gap
    )
    result: dict[str, Any] = {"pid": os.getpid(), "thresholds": vars(thresholds)}
    started = time.monotonic()
    status = 2
    reader = None
    try:
        bus, how = cuda_bus_id()
        reader = make_reader(bus, args.ctypes)
        result.update(
            reader=reader.name, device=reader.info, cuda_device_0_bus_id=bus, bus_id_from=how
        )
        phases = {
            "idle": idle(args.idle),
            "spin": spin(args.duration, args.blocks, args.threads),
            "matmul": matmul(args.duration, args.size),
        }
        result["phases"] = {}
        for name, body in phases.items():
            result["phases"][name] = run_phase(reader, thresholds, args.interval, body)
            time.sleep(3)  # let utilisation and power settle between phases
        p = result["phases"]
        verdicts = {
            "idle_not_flagged": not p["idle"]["flagged"],
            "spin_flagged": p["spin"]["flagged"],
            "matmul_not_flagged": not p["matmul"]["flagged"] and "error" not in p["matmul"],
            "spin_finding_names_this_process": bool(p["spin"]["finding"])
            and str(os.getpid()) in p["spin"]["finding"]["reason"],
        }
        result["verdicts"] = verdicts
        result["ok"] = all(
            verdicts[k] for k in ("idle_not_flagged", "spin_flagged", "matmul_not_flagged")
        )
        status = 0 if result["ok"] else 1
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        if reader is not None:
            try:
                reader.close()
            except Exception:
                pass
    result["total_seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=1, default=str)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    spin_phase = result.get("phases", {}).get("spin", {})
    if spin_phase.get("stopped_cleanly") is False:
        os._exit(3)  # the kernel never saw the flag; do not hang in CUDA teardown
    return status


if __name__ == "__main__":
    sys.exit(main())
