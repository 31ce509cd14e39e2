"""Scrape latency and daemon RSS, against an exporter that shells out to nvidia-smi.

Starts the real daemon (`python -m gpuwatchd run`) on loopback, waits until
ready, scrapes /metrics N times with a new connection each time (as Prometheus
does without keep-alive) and reports p50/p99 latency, exposition size and the
daemon's resident memory. With --peer it also times what nvidia_gpu_exporter
does on every scrape: run `nvidia-smi --query-gpu=... --format=csv` and turn
the CSV into an exposition, so the two are compared in the same run.

    python benchmarks/bench_scrape.py --replay tests/fixtures/nvml/h200x8.json
    python benchmarks/bench_scrape.py --peer            # on a GPU machine: real NVML
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.asyncio_http import daemon_command  # noqa: E402
from benchmarks.report import publish  # noqa: E402

# The fields nvidia_gpu_exporter asks nvidia-smi for (a representative subset of its default).
SMI_FIELDS = (
    "timestamp,driver_version,name,uuid,pci.bus_id,temperature.gpu,temperature.memory,"
    "power.draw,enforced.power.limit,utilization.gpu,utilization.memory,memory.total,"
    "memory.used,memory.free,clocks.sm,clocks.mem,pcie.link.gen.gpucurrent,pcie.link.gen.max,"
    "pcie.link.width.current,pcie.link.width.max,ecc.errors.corrected.volatile.total,"
    "ecc.errors.uncorrected.volatile.total,ecc.errors.corrected.aggregate.total,"
    "ecc.errors.uncorrected.aggregate.total,clocks_event_reasons.active,pstate"
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read()
    conn.close()
    return time.perf_counter() - t0, len(body)


@contextmanager
def running_daemon(
    replay: str | None, config: str = "", src: Path = ROOT
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`gpuwatchd run` on a free loopback port, up and answering; stopped on exit. `src`:
    the tree whose gpuwatchd runs (an earlier revision unpacked for a baseline), its
    bytecode cached as an installed package has it."""
    port = free_port()
    state = tempfile.mkdtemp(prefix="gpuwatchd-bench-")
    cmd = [
        *daemon_command(),
        "run",
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        state,
        "--log-level",
        "warning",
    ]
    if replay:
        cmd += ["--nvml-replay", replay]
    if config:
        (Path(state) / "config.yaml").write_text(config)
        cmd += ["--config", str(Path(state) / "config.yaml")]
    env = None
    if src != ROOT:  # `python -m` puts the working directory first on sys.path
        env = {**os.environ, "PYTHONPATH": str(src)}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.Popen(cmd, cwd=src, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                scrape(port)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("daemon did not come up") from None
                time.sleep(0.1)
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(state, ignore_errors=True)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peer_scrape() -> float:
    """One nvidia-smi based scrape: run the query and render the CSV as an exposition."""
    t0 = time.perf_counter()
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = SMI_FIELDS.split(",")
    lines = []
    for row in out.strip().splitlines():
        for name, value in zip(names, (v.strip() for v in row.split(",")), strict=False):
            try:
                lines.append(f"nvidia_smi_{name.replace('.', '_')}{{}} {float(value)}")
            except ValueError:
                continue
    _exposition = "\n".join(lines)  # the peer renders text too; keep it in the timing
    return time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replay", help="NVML capture to replay (default: real NVML)")
    ap.add_argument("--scrapes", type=int, default=1000)
    ap.add_argument("--peer", action="store_true", help="also time the nvidia-smi exporter")
    ap.add_argument("--peer-scrapes", type=int, default=50)
    ap.add_argument("--section", default="", help="docs/benchmarks.md section name")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--hang",
        action="store_true",
        help="with --replay: every NVML call on GPU 0 blocks forever from the 2nd poll on",
    )
    args = ap.parse_args()
    label = args.replay or "real NVML"
    if args.hang:
        if not args.replay:
            raise SystemExit("--hang needs --replay")
        capture = json.loads(Path(args.replay).read_text())
        capture["script"] = [{"device": 0, "call": "*", "from_poll": 2, "hang": True}]
        hung = Path(tempfile.mkdtemp(prefix="gpuwatchd-hang-")) / "hung.json"
        hung.write_text(json.dumps(capture))
        args.replay = str(hung)

    config = "sources:\n  nvml:\n    interval: 0.5\n    call_timeout: 1\n" if args.hang else ""
    with running_daemon(args.replay, config) as (proc, port):
        time.sleep(4 if args.hang else 2)  # first polls; with --hang, GPU 0 is hung by now
        for _ in range(20):
            scrape(port)  # warm-up
        lat, size = [], 0
        for _ in range(args.scrapes):
            t, size = scrape(port)
            lat.append(t)
        rss = rss_bytes(proc.pid)

    fig = {
        "scrapes": args.scrapes,
        "p50_ms": pct(lat, 0.50) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3,
        "exposition_bytes": size,
        "rss_mib": rss / 2**20,
        "source": label,
    }
    if args.peer and shutil.which("nvidia-smi"):
        peer = [peer_scrape() for _ in range(args.peer_scrapes)]
        fig["peer_p50_ms"] = pct(peer, 0.50) * 1e3
        fig["peer_p99_ms"] = pct(peer, 0.99) * 1e3
        fig["ratio_p50"] = fig["peer_p50_ms"] / fig["p50_ms"]
    rows = [
        f"| NVML data | {fig['source']}"
        + (" with every call on GPU 0 hung (never returns)" if args.hang else "")
        + " |",
        f"| scrapes | {args.scrapes} (new connection each) |",
        f"| /metrics latency p50 | {fig['p50_ms']:.2f} ms |",
        f"| /metrics latency p99 | {fig['p99_ms']:.2f} ms |",
        f"| exposition size | {size} bytes |",
        f"| daemon RSS after the run | {fig['rss_mib']:.1f} MiB |",
    ]
    if "peer_p50_ms" in fig:
        rows += [
            f"| nvidia-smi exporter scrape p50 | {fig['peer_p50_ms']:.1f} ms |",
            f"| nvidia-smi exporter scrape p99 | {fig['peer_p99_ms']:.1f} ms |",
            f"| ratio (nvidia-smi p50 / gpuwatchd p50) | {fig['ratio_p50']:.0f}x |",
        ]
    publish(fig, "Scrape latency", rows, args.section, args.json or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
