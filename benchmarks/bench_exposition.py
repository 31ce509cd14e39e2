"""Rendering the exposition through prometheus_client, per negotiated format.

Runs the daemon in this process on an NVML capture until NVML has polled and
the polls are evaluated, then times, for the text format (0.0.4) and
OpenMetrics: an uncached render of the daemon's registry (collecting the
families from the snapshot, then prometheus_client writing them), gzipping
that body, and a cached scrape as /metrics serves it between snapshots (the
HTTP counters rendered fresh and appended, gzip included). Best of 5 rounds
of 20 calls each.

    .venv/bin/python benchmarks/bench_exposition.py \\
        --replay tests/fixtures/nvml/h200x8-from-h200x2.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import publish  # noqa: E402
from gpuwatchd.daemon import Daemon, Overrides  # noqa: E402
from gpuwatchd.http.counters import BAD_REQUESTS  # noqa: E402
from gpuwatchd.http.exposition import Exposition, negotiate  # noqa: E402

FORMATS = {"text": "", "openmetrics": "application/openmetrics-text; version=1.0.0"}


def best_ms(fn: Callable[[], object], rounds: int = 5, per_round: int = 20) -> float:
    """Best mean wall time of one call over `rounds` rounds, in ms."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_round)
    return best * 1e3


def measure(daemon: Daemon) -> dict[str, Any]:
    """The figures, once the daemon has evaluated its first polls."""
    families = list(daemon.registry.collect())
    fig: dict[str, Any] = {
        "series": sum(len(f.samples) for f in families),
        "families": len(families),
    }
    cached = Exposition(daemon.registry, BAD_REQUESTS, lambda: 0)
    for name, accept in FORMATS.items():
        encoder, _ = negotiate(accept)
        body = encoder(daemon.registry)
        fig[f"{name}_bytes"] = len(body)
        fig[f"{name}_gzip_bytes"] = len(zlib.compress(body, wbits=31))
        fig[f"{name}_render_ms"] = best_ms(partial(encoder, daemon.registry))
        fig[f"{name}_gzip_ms"] = best_ms(partial(zlib.compress, body, wbits=31))
        cached.reply(accept, "gzip")
        fig[f"{name}_cached_scrape_ms"] = best_ms(partial(cached.reply, accept, ""))
        fig[f"{name}_cached_gzip_scrape_ms"] = best_ms(partial(cached.reply, accept, "gzip"))
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", required=True, help="NVML capture to replay")
    ap.add_argument("--section", default="", help="docs/benchmarks.md section name")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as state:
        daemon = Daemon(
            None, Overrides(listen="127.0.0.1:0", nvml_replay=args.replay, state_dir=state)
        )

        def probe() -> None:
            try:
                end = time.monotonic() + 60
                while time.monotonic() < end and (
                    daemon.pipeline is None
                    or daemon.httpd is None
                    or "nvml" not in daemon.state.snapshot().sources
                ):
                    time.sleep(0.05)
                if daemon.pipeline is not None:
                    daemon.pipeline.wait_idle(30.0)
                result.update(measure(daemon))
            finally:
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=probe, daemon=True).start()
        daemon.run()
    if not result:
        return 1
    result["nvml"] = args.replay
    rows = [
        f"| NVML data | {args.replay} |",
        f"| exposition | {result['families']} families, {result['series']} series |",
    ]
    for name in FORMATS:
        rows += [
            f"| {name}: bytes plain / gzip | {result[f'{name}_bytes']} / "
            f"{result[f'{name}_gzip_bytes']} |",
            f"| {name}: uncached render (collect + write) | {result[f'{name}_render_ms']:.2f} ms |",
            f"| {name}: gzip of that body | {result[f'{name}_gzip_ms']:.2f} ms |",
            f"| {name}: cached scrape, plain / gzip | {result[f'{name}_cached_scrape_ms']:.3f} / "
            f"{result[f'{name}_cached_gzip_scrape_ms']:.3f} ms |",
        ]
    publish(result, "Rendering the exposition", rows, args.section, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
