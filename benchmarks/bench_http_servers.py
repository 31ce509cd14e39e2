"""The daemon's HTTP server (epoll, http/server.py) beside its asyncio candidate, one run.

Runs the HTTP benchmarks unchanged against `gpuwatchd run` served by each
implementation in turn (GPUWATCHD_BENCH_HTTP=epoll|asyncio, see
benchmarks/asyncio_http.py), gpuwatchd only, one benchmark at a time with the
two servers back to back, and writes both side by side:

- slow clients: 1,000 held connections of four kinds (bench_http_slow_clients.py);
- stalled TLS: 4,500 ClientHellos, then silence (the same, --kinds hello);
- floods: scrape+idle, bad-password, json-route (bench_http_floods.py);
- scrape latency, 8-GPU replay (bench_scrape.py);
- footprint: idle RSS and CPU beside a bare pynvml process (bench_footprint.py).

    .venv/bin/python benchmarks/bench_http_servers.py --section http-servers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import update_section  # noqa: E402

SERVERS = ("epoll", "asyncio")
REPLAY = "tests/fixtures/nvml/h200x8-from-h200x2.json"


def run(server: str, script: str, args: list[str]) -> dict[str, Any]:
    """One benchmark against one server: its JSON figures."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "GPUWATCHD_BENCH_HTTP": server}
        cmd = [sys.executable, f"benchmarks/{script}", *args, "--json", out.name]
        print(f"[{server}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        return dict(json.loads(Path(out.name).read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scrapes", type=int, default=300, help="scrapes under 1,000 slow clients")
    ap.add_argument("--flood-seconds", type=float, default=10.0)
    ap.add_argument("--footprint-seconds", type=float, default=60.0)
    ap.add_argument("--section", default="", help="docs/benchmarks.md section name")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    only = ["--only", "gpuwatchd"]
    benches = {
        "slow": ("bench_http_slow_clients.py", [*only, "--scrapes", str(args.scrapes)]),
        "stalled": (
            "bench_http_slow_clients.py",
            [*only, "--clients", "4500", "--kinds", "hello", "--scrapes", "100"],
        ),
        "floods": ("bench_http_floods.py", [*only, "--seconds", str(args.flood_seconds)]),
        "scrape": ("bench_scrape.py", ["--replay", REPLAY, "--scrapes", "1000"]),
        "footprint": (
            "bench_footprint.py",
            ["--replay", REPLAY, "--seconds", str(args.footprint_seconds)],
        ),
    }
    fig: dict[str, Any] = {s: {} for s in SERVERS}
    for name, (script, bench_args) in benches.items():
        for server in SERVERS:
            fig[server][name] = run(server, script, bench_args)
    fig["load_average"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))
    if args.section:
        update_section(args.section, report(fig, args))
    return 0


def _latency(g: dict[str, Any]) -> str:
    return f"{g['p50_ms']:,.1f} / {g['p99_ms']:,.1f} ms"


def _slow_failed(run: dict[str, Any]) -> str:
    g = run["gpuwatchd"]
    return f"{g['over_100ms']:.0f} / {g['failures']:.0f} of {run['scrapes']}"


def _slow_rss(g: dict[str, Any]) -> str:
    return f"{g['rss_before_mb']:.0f} / {g['rss_during_mb']:.0f} / {g['rss_after_mb']:.0f} MB"


def _flood_scrapes(g: dict[str, Any]) -> str:
    return f"{g['scrapes_ok']:.0f}/{g['scrapes']:.0f}, " + _latency(g)


def _flood_rss(g: dict[str, Any]) -> str:
    return f"{g['rss_before_mb']:.1f} / {g['rss_peak_mb']:.1f} / {g['rss_after_mb']:.1f} MB"


def report(fig: dict[str, Any], args: Any) -> str:
    rows = ["| figure | epoll (http/server.py) | asyncio candidate |", "| --- | --- | --- |"]

    def row(label: str, path: tuple[str, ...], fmt: Callable[[Any], str]) -> None:
        cells = []
        for server in SERVERS:
            value: Any = fig[server]
            for key in path:
                value = value[key]
            cells.append(fmt(value))
        rows.append(f"| {label} | {' | '.join(cells)} |")

    g = "gpuwatchd"
    for key, label in (("slow", "1,000 slow clients"), ("stalled", "4,500 stalled TLS hellos")):
        row(f"{label}: scrape p50 alone", (key, g), lambda v: f"{v['baseline_p50_ms']:.1f} ms")
        row(f"{label}: scrape p50 / p99", (key, g), _latency)
        row(f"{label}: scrapes over 100 ms / failed", (key,), _slow_failed)
        row(f"{label}: RSS before / under attack / 2 s after", (key, g), _slow_rss)
    for attack in ("scrape+idle", "bad-password", "json-route"):
        row(f"flood {attack}: scrapes OK, p50 / p99", ("floods", attack, g), _flood_scrapes)
        row(f"flood {attack}: RSS before / peak / 2 s after", ("floods", attack, g), _flood_rss)
        row(f"flood {attack}: attack requests answered (any status)", ("floods", attack, g),
            lambda v: f"{v['attack_requests']:,.0f}")  # fmt: skip
    row("scrape latency, 8-GPU replay, p50 / p99", ("scrape",),
        lambda v: f"{v['p50_ms']:.2f} / {v['p99_ms']:.2f} ms")  # fmt: skip
    row("idle RSS (footprint run) / above a bare pynvml process", ("footprint",),
        lambda v: f"{v['daemon_rss_mib']:.1f} / {v['rss_above_floor_mib']:.1f} MiB")  # fmt: skip
    row("idle CPU, share of one core", ("footprint",),
        lambda v: f"{v['daemon_cpu_percent_of_one_core']:.2f} %")  # fmt: skip
    note = (
        "\n\nBoth servers run the same app, dispatcher, pools, web config and limits; "
        "each benchmark ran against one then the other, back to back, gpuwatchd only "
        f"(node_exporter's figures are in the sections above). Floods {args.flood_seconds:.0f} s "
        f"each; footprint {args.footprint_seconds:.0f} s with a Prometheus-style scrape every "
        f"15 s. Load average at the end: {fig['load_average']:.1f}."
    )
    title = "## HTTP server: epoll loop beside the asyncio candidate (http-servers)\n\n"
    return title + "\n".join(rows) + note


if __name__ == "__main__":
    raise SystemExit(main())
