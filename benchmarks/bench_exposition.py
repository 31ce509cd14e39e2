"""Rendering the exposition: gpuwatchd's text-format writer against prometheus_client's.

Runs the daemon in this process on an NVML capture until its first polls are
evaluated, takes the families one scrape would render, and times rendering
the same families with `sinks.exposition.render` and with prometheus_client's
`generate_latest` (the library the daemon used before, and what most Python
exporters run), after checking that both write the same bytes. Also times a
whole uncached scrape render (collecting the families from the snapshot, then
writing them). Best of 5 rounds of 20 renders each.

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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402

from benchmarks.report import publish  # noqa: E402
from gpuwatchd.daemon import Daemon, Overrides  # noqa: E402
from gpuwatchd.sinks.exposition import Family, Registry, render  # noqa: E402


class _Fixed:
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterable[Any]:
        return self.families


def _as_client_families(families: list[Family]) -> list[Any]:
    out: list[Any] = []
    for fam in families:
        if fam.type == "counter":
            ref: Any = CounterMetricFamily(
                fam.name.removesuffix("_total"), fam.help, labels=fam.labels
            )
        else:
            ref = GaugeMetricFamily(fam.name, fam.help, labels=fam.labels)
        for values, value in fam.samples:
            ref.add_metric(list(values), value)
        out.append(ref)
    return out


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
    ours = Registry()
    ours.register(_Fixed(families))
    theirs = CollectorRegistry(auto_describe=False)
    theirs.register(_Fixed(_as_client_families(families)))  # type: ignore[arg-type]
    body = render(ours)
    if body != generate_latest(theirs):
        raise SystemExit("the two writers disagree on this exposition")
    fig: dict[str, Any] = {
        "series": sum(len(f.samples) for f in families),
        "families": len(families),
        "bytes": len(body),
        "gpuwatchd_render_ms": best_ms(lambda: render(ours)),
        "prometheus_client_render_ms": best_ms(lambda: generate_latest(theirs)),
        "uncached_scrape_ms": best_ms(lambda: render(daemon.registry)),
    }
    fig["ratio"] = fig["prometheus_client_render_ms"] / fig["gpuwatchd_render_ms"]
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
                # The HTTP socket and the pipeline exist before the sources have polled:
                # an idle consumer alone measured the daemon's own series only (53).
                deadline = time.monotonic() + 60
                while (
                    daemon.pipeline is None
                    or daemon.httpd is None
                    or "nvml" not in daemon.state.snapshot().sources
                ):
                    if time.monotonic() > deadline:
                        print("bench_exposition: NVML did not poll within 60 s", file=sys.stderr)
                        return
                    time.sleep(0.05)
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
        f"| exposition | {result['families']} families, {result['series']} series, "
        f"{result['bytes']} bytes (identical from both writers) |",
        f"| gpuwatchd `render` | {result['gpuwatchd_render_ms']:.2f} ms |",
        f"| prometheus_client `generate_latest` | {result['prometheus_client_render_ms']:.2f} ms |",
        f"| ratio (prometheus_client / gpuwatchd) | {result['ratio']:.1f}x |",
        f"| uncached scrape (collect + render) | {result['uncached_scrape_ms']:.2f} ms |",
    ]
    publish(result, "Rendering the exposition", rows, args.section, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
