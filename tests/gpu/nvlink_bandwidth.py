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
DEFAULT_OUT = Path("nvlink-bandwidth.json")
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


def _runs(samples: list[dict[str, Any]]) -> list[tuple[float, float, dict[str, float]]]:
    """(last scrape before, first scrape of, values) for each GPM value the scrapes showed.

    The daemon's poll that made a value fell between those two scrapes; a
    scrape that failed tells nothing, so it neither starts nor ends a run.
    """
    out = []
    prev: tuple[float, dict[str, float]] | None = None
    for s in samples:
        gpm = s.get("gpm")
        if not gpm:
            continue
        if prev is not None and gpm != prev[1]:
            out.append((prev[0], s["time"], gpm))
        prev = (s["time"], gpm)
    return out


def infer_gpm_window(samples: list[dict[str, Any]]) -> float | None:
    """The daemon's poll interval from when the scraped value changed (median of the
    mid-points of each change-to-change interval's bounds), None with fewer than 2 changes."""
    runs = _runs(samples)
    mids = [((b[1] - a[1]) + (b[0] - a[0])) / 2 for a, b in zip(runs, runs[1:], strict=False)]
    return statistics.median(mids) if mids else None


def summarize(
    samples: list[dict[str, Any]],
    loop: tuple[float, float],
    ranks: list[dict[str, Any]],
    gpm_window: float,
    smi_gpus: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Per GPU: GPM over the windows wholly inside the all-reduce loop, nvidia-smi's
    rates over the intervals wholly inside, beside NCCL's bus bandwidth.

    A GPM value covers the `gpm_window` seconds before the poll that made it,
    and that poll fell between the last scrape showing the old value and the
    first showing the new one; only values whose whole window lies inside
    `loop` count (a window partly outside mixes idle seconds in).
    """
    start, end = loop
    inside = [
        {"from": before - gpm_window, "to": first, "gpm": gpm}
        for before, first, gpm in _runs(samples)
        if before - gpm_window >= start and first <= end
    ]
    gpm: dict[str, dict[str, list[float]]] = {}
    for w in inside:
        for key, value in w["gpm"].items():
            gpu, direction = key.split("/")
            gpm.setdefault(gpu, {}).setdefault(direction, []).append(value)
    smi: dict[str, dict[str, list[float]]] = {}
    used = 0
    prev_at: float | None = None
    for s in samples:
        # the counters are read after the scrape, within 0.5 s; older JSON has no smi_time
        at = s.get("smi_time", s["time"] + 0.5)
        if prev_at is not None and prev_at >= start and at <= end and s.get("smi_rates"):
            used += 1
            for per in (s["smi_rates"], s.get("smi_raw_rates", {})):
                for uuid, values in per.items():
                    for key, value in values.items():
                        smi.setdefault(uuid, {}).setdefault(key, []).append(value)
        prev_at = s.get("smi_time", s["time"])
    med = statistics.median
    rank0 = next((r for r in ranks if r.get("rank") == 0), {})
    busbw = rank0.get("busbw_bytes_per_second")
    if smi_gpus is None:
        # nvidia-smi prints GPUs in index order; the first sample's keys keep that order
        first = next((s["smi_rates"] for s in samples if s.get("smi_rates")), {})
        smi_gpus = {uuid: str(i) for i, uuid in enumerate(first)}
    gpm_med = {g: {d: med(v) for d, v in dirs.items()} for g, dirs in sorted(gpm.items())}
    smi_med = {smi_gpus.get(u, u): {k: med(v) for k, v in keys.items()} for u, keys in smi.items()}
    out: dict[str, Any] = {
        "loop": {"start": start, "end": end},
        "gpm_window_seconds": gpm_window,
        "gpm_windows_inside": inside,
        "smi_intervals_inside": used,
        "nccl": rank0,
        "gpm_median_bytes_per_second": gpm_med,
        "nvidia_smi_gt_median_bytes_per_second": dict(sorted(smi_med.items())),
        "smi_gpus": smi_gpus,
    }
    if busbw:
        out["gpm_tx_over_busbw"] = {
            g: round(d["tx"] / busbw, 3) for g, d in gpm_med.items() if "tx" in d
        }
        out["smi_data_tx_over_busbw"] = {
            g: round(d["data_tx"] / busbw, 3) for g, d in sorted(smi_med.items()) if "data_tx" in d
        }
        raw = {g: round(d["raw_tx"] / busbw, 3) for g, d in smi_med.items() if "raw_tx" in d}
        if raw:
            out["smi_raw_tx_over_busbw"] = dict(sorted(raw.items()))
    return out


def loop_of(ranks: list[dict[str, Any]]) -> tuple[float, float]:
    """The seconds every rank spent in the timed all-reduce loop."""
    return max(r["start"] for r in ranks), min(r["end"] for r in ranks)


def summarize_saved(path: Path, gpm_window: float | None) -> dict[str, Any]:
    """The summary of a JSON written by an earlier run (no GPU needed)."""
    doc = json.loads(path.read_text())
    samples, ranks = doc.get("samples", []), doc.get("ranks", [])
    inferred = infer_gpm_window(samples)
    if gpm_window is not None:
        window, how = gpm_window, "--gpm-window"
    elif doc.get("gpm_window_seconds"):
        window, how = float(doc["gpm_window_seconds"]), "saved with the run"
    elif inferred is not None:
        window, how = inferred, "inferred from when the scraped value changed"
    else:
        window, how = 10.0, "default (10 s, a running daemon's poll)"
    out = summarize(samples, loop_of(ranks), ranks, window, doc.get("smi_gpus"))
    out["gpm_window_from"] = how
    out["gpm_window_inferred_seconds"] = inferred
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


def smi_gpu_indexes(text: str) -> dict[str, str]:
    """{uuid: GPU index} from an nvidia-smi listing ("GPU 0: ... (UUID: GPU-...)")."""
    return {u: i for i, u in re.findall(r"^GPU (\d+): .*\(UUID: (GPU-[0-9a-fA-F-]+)\)", text, re.M)}


def sample_loop(url: str, smi: str, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """Once a second: the daemon's GPM NVLink rates and nvidia-smi's -gt d and -gt r
    counter rates (each entry's smi_time: when the counters were read)."""
    from smi_nvlink import parse_nvlink_throughput, run_smi, throughput_rates

    prev: tuple[float, Any, Any] | None = None
    while not stop.wait(1.0):
        now = time.time()
        entry: dict[str, Any] = {"time": now}
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                body = resp.read().decode()
            entry["gpm"] = {f"{g}/{d}": v for (g, d), v in parse_gpm(body).items()}
        except OSError as exc:
            entry["gpm_error"] = str(exc)
        text = run_smi(smi, "nvlink", "-gt", "d", timeout=10)
        raw = parse_nvlink_throughput(run_smi(smi, "nvlink", "-gt", "r", timeout=10))
        counters = parse_nvlink_throughput(text)
        t = time.monotonic()
        entry["smi_time"] = time.time()
        if not out:
            entry["smi_gpus"] = smi_gpu_indexes(text)
        if prev is not None and counters:
            entry["smi_rates"] = throughput_rates(prev[1], counters, t - prev[0])
            entry["smi_raw_rates"] = throughput_rates(prev[2], raw, t - prev[0])
        prev = (t, counters, raw)
        out.append(entry)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the JSON (with --summarize: the summary)"
    )
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--gpus", type=int, default=0, help="ranks (default: every GPU)")
    ap.add_argument("--metrics-url", default="", help="a running daemon's /metrics")
    ap.add_argument("--nvidia-smi", default="nvidia-smi")
    ap.add_argument(
        "--gpm-window",
        type=float,
        default=None,
        help="seconds a GPM value covers: the daemon's poll interval (default 1 for the "
        "daemon this script starts, 10 with --metrics-url)",
    )
    ap.add_argument(
        "--summarize",
        type=Path,
        metavar="JSON",
        help="print the summary of a JSON an earlier run wrote (no GPU needed)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.update(NO_MULTICAST)
    if args.worker:
        return worker(args)
    if args.summarize:
        summary = summarize_saved(args.summarize, args.gpm_window)
        text = json.dumps(summary, indent=1)
        print(text)
        if args.out != DEFAULT_OUT:
            args.out.write_text(text + "\n")
        return 0

    import torch

    gpus = args.gpus or torch.cuda.device_count()
    gpm_window = args.gpm_window or (10.0 if args.metrics_url else 1.0)
    doc: dict[str, Any] = {
        "gpus": gpus,
        "env": NO_MULTICAST,
        "seconds": args.seconds,
        "gpm_window_seconds": gpm_window,
    }
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
    smi_gpus = next((s["smi_gpus"] for s in samples if s.get("smi_gpus")), None)
    doc["smi_gpus"] = smi_gpus
    if ranks:
        doc["summary"] = summarize(samples, loop_of(ranks), ranks, gpm_window, smi_gpus)
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc.get("summary", {"error": doc.get("torchrun_tail", "")}), indent=1))
    return 0 if ranks else 1


if __name__ == "__main__":
    raise SystemExit(main())
