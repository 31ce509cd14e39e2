"""`python -m gpuwatchd.diag.worker`: the GPU half of `gpuwatchd diag`.

Runs in its own process group, started by the runner, and prints one JSON
`Measurement` per line as each check ends, then `{"done": true}`. It
imports CuPy or PyTorch (the `gpuwatchd[diag]` extra); the daemon never
does. It asks the kernel for SIGKILL when the process that started it
dies (PR_SET_PDEATHSIG), so a `diag` killed with SIGKILL leaves no worker
on the GPUs; other ends (signals, timeouts) kill its whole group.
`--fake FILE` replays canned measurements with pauses instead of touching
a GPU: the test suite's stand-in for a real worker.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpuwatchd.diag.worker.measure import Measurement

__all__ = ["Options", "die_with_parent", "load_backend", "main", "run_checks"]

GIB = 1 << 30
MIB = 1 << 20
PATTERNS = (0x00000000, 0xFFFFFFFF, 0xAAAAAAAA, 0x55555555)
PARENT_ENV = "GPUWATCHD_DIAG_PARENT"  # set by the runner (sources/diag/runner.py) to its pid
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> bool:
    """SIGKILL this process when its parent dies; exit now if it already has. False off Linux."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit() and os.getppid() != int(parent) and not _alive(int(parent)):
        os._exit(3)  # the parent died before the request took effect: nobody reads us
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Options:
    """Sizes of the work; the defaults are what the tiers run on a real node."""

    gemm_n = 8192
    gemm_iters = 20
    copy_bytes = 1 * GIB
    h2d_bytes = 256 * MIB
    p2p_bytes = 256 * MIB
    copy_iters = 20
    all_reduce_bytes = 1 * GIB
    all_reduce_iters = 20
    memory_fraction = 0.9
    memory_chunk = 512 * MIB


def load_backend(name: str) -> Any:
    """The GPU library: CuPy when installed (lighter), else PyTorch; or the one named."""
    order = ("cupy", "torch") if name == "auto" else (name,)
    errors = []
    for candidate in order:
        try:
            if candidate == "cupy":
                from gpuwatchd.diag.worker.gpu_cupy import CupyBackend

                return CupyBackend()
            from gpuwatchd.diag.worker.gpu_torch import TorchBackend

            return TorchBackend()
        except ImportError as exc:
            errors.append(f"{candidate}: {exc}")
    raise ImportError("no GPU library for diag (install gpuwatchd[diag]): " + "; ".join(errors))


def _timed(
    check: str, gpu: str, unit: str, fn: Callable[[], tuple[float | None, bool, str]]
) -> Measurement:
    """Run one check; an exception becomes the measurement's error, not a crash."""
    t0 = time.monotonic()
    try:
        value, correct, detail = fn()
    except Exception as exc:  # the worker reports every failure as data
        return Measurement(
            check,
            gpu,
            None,
            unit,
            error=f"{type(exc).__name__}: {exc}"[:300],
            seconds=time.monotonic() - t0,
        )
    return Measurement(check, gpu, value, unit, correct, detail, seconds=time.monotonic() - t0)


def run_checks(backend: Any, tier: str, gpus: Sequence[int], opt: Options) -> Iterator[Measurement]:
    """The GPU checks of `tier` on `gpus` (CUDA indices in PCI bus order)."""
    for dev in gpus:
        g = str(dev)

        def gemm(dev: int = dev) -> tuple[float | None, bool, str]:
            tflops, err, dtype = backend.gemm(dev, opt.gemm_n, opt.gemm_iters)
            return tflops, err < 0.02, f"{dtype} {opt.gemm_n}^3, max error {err:.2e} of scale"

        yield _timed("gemm", g, "TFLOP/s", gemm)

        def h2d(dev: int = dev) -> tuple[float | None, bool, str]:
            return backend.h2d(dev, opt.h2d_bytes, opt.copy_iters) / 1e9, True, "pinned host memory"

        def d2d(dev: int = dev) -> tuple[float | None, bool, str]:
            rate = backend.d2d(dev, opt.copy_bytes, opt.copy_iters)
            return rate / 1e9, True, "bytes read plus written"

        yield _timed("h2d_bandwidth", g, "GB/s", h2d)
        yield _timed("d2d_bandwidth", g, "GB/s", d2d)
    if tier != "standard":
        return
    for src, dst in itertools.permutations(gpus, 2):

        def p2p(src: int = src, dst: int = dst) -> tuple[float | None, bool, str]:
            rate, peer = backend.p2p(src, dst, opt.p2p_bytes, opt.copy_iters)
            return rate / 1e9, True, "peer access" if peer else "no peer access (through host)"

        yield _timed("p2p_bandwidth", f"{src}>{dst}", "GB/s", p2p)
    if len(gpus) > 1:

        def all_reduce() -> tuple[float | None, bool, str]:
            n = len(gpus)
            algbw, right = backend.all_reduce(gpus, opt.all_reduce_bytes, opt.all_reduce_iters)
            busbw = algbw * 2 * (n - 1) / n
            return (
                busbw / 1e9,
                right,
                (
                    f"{n} GPUs, {opt.all_reduce_bytes / GIB:g} GiB float32 sum, "
                    f"algbw {algbw / 1e9:.1f} GB/s, busbw = algbw*2(n-1)/n"
                    + ("" if right else ", WRONG SUM")
                ),
            )

        yield _timed("all_reduce", "all", "GB/s", all_reduce)
    for dev in gpus:

        def memory(dev: int = dev) -> tuple[float | None, bool, str]:
            tested, bad, rate = backend.memory_pattern(
                dev, opt.memory_fraction, opt.memory_chunk, PATTERNS
            )
            return (
                float(bad),
                bad == 0,
                (f"{tested / GIB:.1f} GiB x {len(PATTERNS) + 1} patterns, {rate / 1e9:.0f} GB/s"),
            )

        yield _timed("memory_pattern", str(dev), "words", memory)


def _fake(path: str) -> int:
    """Replay canned lines: {"sleep": s} pauses, {"exit": n} exits without the final
    line, {"spawn": argv, "pidfile": f} starts a child in the worker's process group
    (as CUDA libraries start helpers) and writes its pid; others are printed."""
    import subprocess

    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            data = json.loads(line)
            if "sleep" in data:
                time.sleep(float(data["sleep"]))
            elif "spawn" in data:
                child = subprocess.Popen(data["spawn"])
                with open(data["pidfile"] + ".tmp", "w", encoding="utf-8") as pidfile:
                    pidfile.write(str(child.pid))
                os.replace(data["pidfile"] + ".tmp", data["pidfile"])
            elif "exit" in data:
                return int(data["exit"])
            else:
                print(json.dumps(data), flush=True)
    print(json.dumps({"done": True}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the checks, print one JSON line per measurement."""
    p = argparse.ArgumentParser(prog="gpuwatchd-diag-worker")
    p.add_argument("--tier", choices=("quick", "standard"), default="quick")
    p.add_argument("--gpus", default="", help="comma-separated CUDA indices (default: all)")
    p.add_argument("--backend", choices=("auto", "cupy", "torch"), default="auto")
    p.add_argument("--fake", metavar="FILE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    die_with_parent()
    if args.fake:
        return _fake(args.fake)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA index = NVML index
    try:
        backend = load_backend(args.backend)
        count = backend.device_count()
    except Exception as exc:
        print(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
        return 3
    gpus = [int(x) for x in args.gpus.split(",") if x] or list(range(count))
    print(json.dumps({"hello": {"backend": backend.name, "devices": count}}), flush=True)
    for m in run_checks(backend, args.tier, gpus, Options()):
        print(m.to_json(), flush=True)
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
