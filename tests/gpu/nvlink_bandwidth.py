#!/usr/bin/env python3
"""GPM NVLink throughput (the dashboard's NVLink panel) against NCCL's bus bandwidth.

Runs a 1 GiB all-reduce loop on every GPU with torchrun for --seconds (20),
times it with torch.distributed (CUDA synchronised, per iteration), and
meanwhile, once a second, scrapes gpuwatchd's /metrics
(`gpuwatchd_gpu_nvlink_bytes_per_second`) and reads `nvidia-smi nvlink -gt d`.
A ring all-reduce of S bytes on n GPUs sends 2(n-1)/n * S bytes from each GPU,
so each GPU's NVLink tx rate should be NCCL's bus bandwidth (algbw * 2(n-1)/n)
when all traffic goes over NVLink. Writes one JSON object to --out:

    python tests/gpu/nvlink_bandwidth.py --out nvlink-bw.json [--seconds 20] [--size-gib 1]

Starts its own daemon (real NVML, 1 s poll) unless --metrics-url names a
running one. NVLink SHARP/multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, always set).
Every wait is bounded; exit 0 when the loop ran and the JSON was written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_GPM = re.compile(r"^gpuwatchd_gpu_nvlink_bytes_per_second\{([^}]*)\} (\S+)$", re.MULTILINE)


def parse_gpm(exposition: str) -> dict[tuple[str, str], float]:
    """{(gpu index, "tx"|"rx"): bytes/s} from a /metrics body."""
    out = {}
    for labels, value in _GPM.findall(exposition):
        lab = dict(re.findall(r'([a-z_]+)="([^"]*)"', labels))
        out[(lab.get("gpu", ""), lab.get("direction", ""))] = float(value)
    return out


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """NCCL's bus bandwidth of an all-reduce (nccl-tests' PERFORMANCE.md)."""
    return algbw * 2 * (ranks - 1) / ranks if ranks > 1 else algbw


def summarize(
    samples: list[dict[str, Any]], window: tuple[float, float], ranks: list[dict[str, Any]]
) -> dict[str, Any]:
    """Medians over the timed all-reduce window, per GPU, beside NCCL's figures."""
    inside = [s for s in samples if window[0] <= s["time"] <= window[1]]
    gpm: dict[str, dict[str, list[float]]] = {}
    smi: dict[str, dict[str, list[float]]] = {}
    for s in inside:
        for key, value in s.get("gpm", {}).items():
            gpu, direction = key.split("/")
            gpm.setdefault(gpu, {}).setdefault(direction, []).append(value)
        for uuid, rates in s.get("smi_rates", {}).items():
            for key, value in rates.items():
                smi.setdefault(uuid, {}).setdefault(key, []).append(value)
    med = statistics.median
    rank0 = next((r for r in ranks if r.get("rank") == 0), {})
    busbw = rank0.get("busbw_bytes_per_second")
    out: dict[str, Any] = {
        "samples_in_window": len(inside),
        "nccl": rank0,
        "gpm_median_bytes_per_second": {
            g: {d: med(v) for d, v in dirs.items() if v} for g, dirs in sorted(gpm.items())
        },
        "nvidia_smi_gt_median_bytes_per_second": {
            u: {k: med(v) for k, v in keys.items() if v} for u, keys in sorted(smi.items())
        },
    }
    if busbw:
        out["gpm_tx_over_busbw"] = {
            g: round(d["tx"] / busbw, 3)
            for g, d in out["gpm_median_bytes_per_second"].items()
            if "tx" in d
        }
    return out


def worker(args: argparse.Namespace) -> int:
    """One torchrun rank: a calibrated, fixed-count all-reduce loop (every rank the same)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    size = int(args.size_gib * 2**30)
    x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 10
    # rank 0 decides the count so that no rank waits in an all-reduce the others skip
    count = torch.tensor([max(1, int(args.seconds / per))], device="cuda")
    dist.broadcast(count, 0)
    times = []
    start = time.time()
    for _ in range(int(count.item())):
        t = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    end = time.time()
    med = statistics.median(times)
    algbw = size / med
    result = {
        "rank": rank,
        "world": world,
        "bytes": size,
        "iterations": len(times),
        "start": start,
        "end": end,
        "median_seconds": med,
        "algbw_bytes_per_second": algbw,
        "busbw_bytes_per_second": bus_bandwidth(algbw, world),
        "nccl_version": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "torch": torch.__version__,
    }
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def sample_loop(url: str, smi: str, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """Once a second: the daemon's GPM NVLink rates and nvidia-smi's -gt d counter rates."""
    from smi_nvlink import parse_nvlink_throughput, run_smi, throughput_rates

    prev: tuple[float, Any] | None = None
    while not stop.wait(1.0):
        now = time.time()
        entry: dict[str, Any] = {"time": now}
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                body = resp.read().decode()
            entry["gpm"] = {f"{g}/{d}": v for (g, d), v in parse_gpm(body).items()}
        except OSError as exc:
            entry["gpm_error"] = str(exc)
        counters = parse_nvlink_throughput(run_smi(smi, "nvlink", "-gt", "d", timeout=10))
        t = time.monotonic()
        if prev is not None and counters:
            entry["smi_rates"] = throughput_rates(prev[1], counters, t - prev[0])
        prev = (t, counters)
        out.append(entry)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("nvlink-bandwidth.json"))
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--gpus", type=int, default=0, help="ranks (default: every GPU)")
    ap.add_argument("--metrics-url", default="", help="a running daemon's /metrics")
    ap.add_argument("--nvidia-smi", default="nvidia-smi")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.update(NO_MULTICAST)
    if args.worker:
        return worker(args)

    import torch

    gpus = args.gpus or torch.cuda.device_count()
    doc: dict[str, Any] = {"gpus": gpus, "env": NO_MULTICAST, "seconds": args.seconds}
    samples: list[dict[str, Any]] = []
    results = Path(args.out).with_suffix(".ranks")
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    with ExitStack() as stack:
        url = args.metrics_url
        if not url:
            from benchmarks.bench_scrape import running_daemon

            config = (
                "sources:\n  nvml:\n    interval: 1\n  kmsg:\n    enabled: false\n"
                "  udev:\n    enabled: false\n"
            )
            _, port = stack.enter_context(running_daemon(None, config))
            url = f"http://127.0.0.1:{port}/metrics"
        stop = threading.Event()
        sampler = threading.Thread(
            target=sample_loop, args=(url, args.nvidia_smi, stop, samples), daemon=True
        )
        sampler.start()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={gpus}", str(Path(__file__).resolve()), "--worker",
            "--seconds", str(args.seconds), "--size-gib", str(args.size_gib),
            "--result-dir", str(results),
        ]  # fmt: skip
        try:
            run = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.seconds + 180, env=os.environ
            )
            doc["torchrun_rc"] = run.returncode
            doc["torchrun_tail"] = (run.stdout + run.stderr)[-4000:]
        except subprocess.TimeoutExpired as exc:
            doc["torchrun_rc"] = "timeout"
            doc["torchrun_tail"] = str(exc)[-4000:]
        time.sleep(2.0)  # one more daemon poll after the loop
        stop.set()
        sampler.join(timeout=30)
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]
    doc["ranks"] = ranks
    doc["samples"] = samples
    if ranks:
        window = (max(r["start"] for r in ranks) + 1.5, min(r["end"] for r in ranks) - 0.5)
        doc["summary"] = summarize(samples, window, ranks)
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc.get("summary", {"error": doc.get("torchrun_tail", "")}), indent=1))
    return 0 if ranks else 1


if __name__ == "__main__":
    raise SystemExit(main())
