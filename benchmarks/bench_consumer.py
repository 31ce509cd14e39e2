"""What a publish costs the source thread, and how soon the consumer thread acts on it.

- Source-thread cost of a publish (a 2-GPU NVML replay snapshot, or a
  kernel-log poll with one Xid report), store writes included:
  `State.publish` with the daemon's one listener (the `PublishQueue`),
  against the same chain run synchronously in the publishing thread (what
  the daemon did before the consumer thread).
- Latency from `State.publish` of a kernel-log Xid to the consumer having
  run the Xid stage (store write included) and the health engine.
- A store that cannot be written (another process holds an exclusive lock
  on the SQLite file): the longest a publish takes meanwhile, and what
  waits (latest snapshot per source; events kept).

    .venv/bin/python benchmarks/bench_consumer.py [--publishes 2000] [--no-write]
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import publish  # noqa: E402
from gpuwatchd.clock import FakeClock, SystemClock  # noqa: E402
from gpuwatchd.config import load  # noqa: E402
from gpuwatchd.model import Event, Severity, SourceSnapshot  # noqa: E402
from gpuwatchd.pipeline import Consumers, SourceSet  # noqa: E402
from gpuwatchd.pipeline.daemon import Pipeline  # noqa: E402
from gpuwatchd.sinks.store import EventStore  # noqa: E402
from gpuwatchd.state import State  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-record.json"
BUS = "0000:00:06.0"


def config(tmp: Path) -> str:
    path = tmp / "config.yaml"
    path.write_text(
        f"daemon:\n  state_dir: {tmp}\nsources:\n  nvml:\n    replay: {CAPTURE}\n"
        "  kmsg:\n    enabled: false\n  udev:\n    enabled: false\n"
    )
    return str(path)


def nvml_snapshot(cfg_path: str) -> SourceSnapshot:
    state = State()
    sources = SourceSet(load(cfg_path), state, FakeClock())
    snap = sources.runner.poll_once("nvml")
    sources.stop()
    return snap


def xid(n: int) -> Event:
    return Event(
        "xid",
        "kmsg",
        time.time(),
        code=13,
        pci_bus_id=BUS,
        severity=Severity.WARNING,
        message=f"Graphics SM Warp Exception #{n}",
        attrs=(("cursor", str(n)), ("pid", str(10_000 + n)), ("process", "python3")),
    )


def kmsg_snapshot(n: int) -> SourceSnapshot:
    return SourceSnapshot("kmsg", (), True, timestamp=time.time(), status={"cursor": str(n)})


def us(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values) * 1e6, values[int(len(values) * 0.99) - 1] * 1e6


def source_cost(cfg_path: str, n: int) -> dict[str, float]:
    """Per-publish time in the publishing thread: queued vs. run in place."""
    snap = nvml_snapshot(cfg_path)
    out: dict[str, float] = {}
    for mode in ("queued", "in_thread"):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load(config(Path(tmp)))
            state = State()
            store = EventStore.from_config(cfg)  # writes cost what they cost the daemon
            chain = Consumers(cfg, state, SystemClock(), store, ["nvml", "kmsg"])
            if mode == "in_thread":
                state.subscribe(chain.xids.on_publish)
                state.subscribe(chain.engine.on_publish)
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                state.publish(snap if i % 2 else kmsg_snapshot(i), (xid(i),) if i % 2 == 0 else ())
                times.append(time.perf_counter() - t0)
                if mode == "queued" and i % 50 == 49:
                    chain.drain()  # keep the queue from growing: not timed
            store.close()
            out[f"{mode}_p50_us"], out[f"{mode}_p99_us"] = us(times)
    return out


def consumer_latency(cfg_path: str, n: int) -> dict[str, float]:
    """State.publish of an Xid -> the consumer ran the Xid stage (stored) and the engine."""
    cfg = load(cfg_path)
    state = State()
    pipeline = Pipeline(cfg, state, SystemClock(), "bench", 0, ["kmsg"])
    pipeline.start()
    lat = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            state.publish(kmsg_snapshot(i), (xid(i),))
            pipeline.wait_idle(5.0)
            lat.append(time.perf_counter() - t0)
    finally:
        pipeline.stop()
    p50, p99 = us(lat)
    return {"latency_p50_us": p50, "latency_p99_us": p99}


def locked_store(cfg_path: str, seconds: float) -> dict[str, float]:
    """Another connection holds the SQLite file exclusively for `seconds`."""
    cfg = load(cfg_path)
    state = State()
    pipeline = Pipeline(cfg, state, SystemClock(), "bench", 0, ["kmsg"])
    pipeline.start()
    blocker = sqlite3.connect(str(Path(cfg.daemon.state_dir) / "gpuwatchd.db"), timeout=1)
    blocker.execute("BEGIN EXCLUSIVE")
    worst, published = 0.0, 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            state.publish(kmsg_snapshot(published), (xid(published),))
            worst = max(worst, time.perf_counter() - t0)
            published += 1
            threading.Event().wait(0.01)  # a kernel log source polling twice as fast as usual
        waiting = pipeline.queue.depth()
    finally:
        blocker.rollback()
        blocker.close()
        caught_up = pipeline.wait_idle(60.0)
        pipeline.stop()
    return {
        "publishes_while_locked": published,
        "worst_publish_us": worst * 1e6,
        "sources_waiting_at_unlock": waiting,
        "caught_up_after_unlock": int(caught_up),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--publishes", type=int, default=2000)
    ap.add_argument("--locked-seconds", type=float, default=3.0)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # thousands of Xid reports: keep the output to the figures
    fig: dict[str, object] = {"load_average_1m_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as tmp:
        path = config(Path(tmp))
        fig.update(source_cost(path, args.publishes))
    with tempfile.TemporaryDirectory() as tmp:
        fig.update(consumer_latency(config(Path(tmp)), args.publishes // 4))
    with tempfile.TemporaryDirectory() as tmp:
        fig.update(locked_store(config(Path(tmp)), args.locked_seconds))
    rows = [
        f"| publish in the source thread, queued (p50 / p99) | {fig['queued_p50_us']:.0f} /"
        f" {fig['queued_p99_us']:.0f} µs |",
        f"| same chain run in the source thread, as before (p50 / p99) |"
        f" {fig['in_thread_p50_us']:.0f} / {fig['in_thread_p99_us']:.0f} µs |",
        f"| publish of an Xid -> stored and evaluated by the consumer (p50 / p99) |"
        f" {fig['latency_p50_us']:.0f} / {fig['latency_p99_us']:.0f} µs |",
        f"| store locked by another process for {args.locked_seconds:g} s: publishes /"
        f" worst publish | {fig['publishes_while_locked']} /"
        f" {fig['worst_publish_us']:.0f} µs |",
        f"| ... sources waiting at unlock / caught up | {fig['sources_waiting_at_unlock']} /"
        f" {'yes' if fig['caught_up_after_unlock'] else 'no'} |",
        f"| load average (1 min) when the run started | {fig['load_average_1m_at_start']} |",
    ]
    publish(fig, "Consumer thread", rows, section="" if args.no_write else "consumer")


if __name__ == "__main__":
    main()
