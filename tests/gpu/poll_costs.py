#!/usr/bin/env python3
"""What each NVML call of the steady poll costs on a real GPU, wall and CPU time.

Uses the daemon's own NVML source and client with a timing wrapper around
every device call, so it times exactly what `gpuwatchd run` asks:

(a) every call of the steady poll (statics and NVLink error counters read
    every poll so that they are timed too), p50/p95 over --polls polls
    after two warm-up polls, wall time and the calling thread's CPU time;
(b) one full steady poll (all GPUs) with `sources.nvml.static_interval` 0
    against its default, wall and process CPU time;
(c) nvmlDeviceGetTotalEnergyConsumption against the same value through
    nvmlDeviceGetFieldValues (NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION) alone and
    added to the poll's field batch;
(d) each field of the poll's field batch asked alone, to find the costly ones;
(e) the CPU time of the Xid event wait (nvmlEventSetWait, 5 s timeout).

Prints a table and writes everything as JSON to --out. Needs only
nvidia-ml-py and the repository; without a GPU, --nvml-replay FILE serves
a capture instead (the times are then the replay's, not a driver's).

    python3 tests/gpu/poll_costs.py --polls 30 --out poll-costs.json
    python3 tests/gpu/poll_costs.py --polls 5 \
        --nvml-replay tests/fixtures/nvml/h100-idle-record.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatchd.config import NvmlConfig  # noqa: E402
from gpuwatchd.errors import NvmlError, SourceError  # noqa: E402
from gpuwatchd.sources.nvml.client import (  # noqa: E402
    FieldKey,
    FieldResult,
    NvmlClient,
    NvmlDevice,
    Pynvml,
    XidEventSet,
    call_key,
)
from gpuwatchd.sources.nvml.perf import clock_event_fields  # noqa: E402
from gpuwatchd.sources.nvml.read import (  # noqa: E402
    FI_DRAIN_AND_RESET,
    FI_MEMORY_TEMP,
    FI_RECOVERY_ACTION,
    FI_RESET_STATUS,
    PCIE_ERROR_FIELDS,  # noqa: E402
)
from gpuwatchd.sources.nvml.source import NvmlSource  # noqa: E402
from gpuwatchd.sources.nvml.static import STATIC_CALLS  # noqa: E402

T = TypeVar("T")
FI_ENERGY = "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
# what the daemon reads on a slower cadence than every poll (sources.nvml.*_interval)
SLOW_CADENCE = {name: "static_interval" for name in STATIC_CALLS} | {
    "nvlink_error_counter": "nvlink_error_interval"
}


class Timings:
    """(gpu, call) -> [(wall us, thread CPU us)], filled from the per-GPU worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.on = True
        self.calls: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
        self.failed: dict[tuple[int, str], str] = {}

    def timed(self, index: int, key: str, fn: Callable[[], T]) -> T:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn()
        except NvmlError as exc:
            with self._lock:
                self.failed[(index, key)] = exc.code
            raise
        finally:
            spent = ((time.perf_counter() - wall) * 1e6, (time.thread_time() - cpu) * 1e6)
            if self.on:
                with self._lock:
                    self.calls[(index, key)].append(spent)

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


class TimedDevice:
    """An NvmlDevice whose every call is timed."""

    def __init__(self, inner: NvmlDevice, timings: Timings) -> None:
        self.inner = inner
        self.index = inner.index
        self._t = timings

    def call(self, name: str, *args: int) -> object:
        key = call_key(name, args)
        return self._t.timed(self.index, key, lambda: self.inner.call(name, *args))

    def field_values(self, fields: Sequence[FieldKey]) -> Mapping[FieldKey, FieldResult]:
        return self._t.timed(self.index, "field_values", lambda: self.inner.field_values(fields))

    def release(self) -> None:
        release = getattr(self.inner, "release", None)
        if callable(release):
            release()


class TimedClient:
    """An NvmlClient handing out timed devices."""

    def __init__(self, inner: NvmlClient, timings: Timings) -> None:
        self.inner = inner
        self._t = timings

    def init(self) -> None:
        self.inner.init()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def call(self, name: str) -> object:
        return self.inner.call(name)

    def device(self, index: int) -> TimedDevice:
        return TimedDevice(self.inner.device(index), self._t)

    def xid_events(self, devices: Sequence[NvmlDevice]) -> XidEventSet:
        inner = [d.inner if isinstance(d, TimedDevice) else d for d in devices]
        return self.inner.xid_events(inner)


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0-1) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(pct(values, 0.5), 1),
        "p95": round(pct(values, 0.95), 1),
        "mean": round(statistics.fmean(values), 1) if values else 0.0,
    }


def make_client(replay: str) -> NvmlClient:
    if replay:
        from gpuwatchd.sources.nvml.replay import ReplayClient

        return ReplayClient.load(replay)
    return Pynvml()


def poll_n(source: NvmlSource, polls: int, gap: float) -> list[tuple[float, float]]:
    """(wall ms, process CPU ms) of each of `polls` polls."""
    out = []
    for _ in range(polls):
        time.sleep(gap)
        wall, cpu = time.perf_counter(), time.process_time()
        source.poll(time.time())
        out.append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
    return out


def per_call(args: argparse.Namespace) -> dict[str, Any]:
    """(a): every call of the steady poll, static and NVLink error counters included."""
    timings = Timings()
    client = TimedClient(make_client(args.nvml_replay), timings)
    source = NvmlSource(client, call_timeout=10.0, nvlink_error_interval=0.0, static_interval=0.0)
    try:
        poll_n(source, 2, args.gap)  # discovery, GPM's first sample, unsupported calls memoised
        timings.clear()
        polls = poll_n(source, args.polls, args.gap)
    finally:
        source.close()
    rows: list[dict[str, Any]] = []
    for (gpu, key), spent in sorted(timings.calls.items()):
        name = key.split("(", 1)[0]
        rows.append(
            {
                "gpu": gpu,
                "call": key,
                "count": len(spent),
                "wall_us": summary([w for w, _ in spent]),
                "cpu_us": summary([c for _, c in spent]),
                "error": timings.failed.get((gpu, key), ""),
                "cadence": SLOW_CADENCE.get(name, "every poll"),
            }
        )
    rows.sort(key=lambda r: -r["wall_us"]["mean"] * r["count"])
    return {
        "rows": rows,
        "poll_wall_ms": summary([w for w, _ in polls]),
        "poll_cpu_ms": summary([c for _, c in polls]),
    }


def full_polls(args: argparse.Namespace) -> dict[str, Any]:
    """(b): whole steady polls, statics every poll against the default cadence."""
    out: dict[str, Any] = {}
    for label, every in (("static_interval=0", 0.0), ("default", NvmlConfig().static_interval)):
        source = NvmlSource(
            make_client(args.nvml_replay),
            call_timeout=10.0,
            nvlink_error_interval=NvmlConfig().nvlink_error_interval,
            static_interval=every,
        )
        try:
            poll_n(source, 2, args.gap)
            polls = poll_n(source, args.polls, args.gap)
        finally:
            source.close()
        out[label] = {
            "static_interval": every,
            "wall_ms": summary([w for w, _ in polls]),
            "cpu_ms": summary([c for _, c in polls]),
        }
    return out


def steady_fields() -> list[FieldKey]:
    """The field batch of a steady poll (NVLink speeds left out: per-link, often absent)."""
    return [
        (FI_MEMORY_TEMP, 0),
        (FI_RECOVERY_ACTION, 0),
        (FI_RESET_STATUS, 0),
        (FI_DRAIN_AND_RESET, 0),
        *[(name, 0) for name in PCIE_ERROR_FIELDS],
        *clock_event_fields(),
    ]


def timed_n(n: int, fn: Callable[[], object]) -> tuple[list[float], list[float], str]:
    """Wall and thread CPU microseconds of n calls of fn; the error code if it failed."""
    walls, cpus, error = [], [], ""
    for _ in range(n):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            fn()
        except NvmlError as exc:
            error = exc.code
        walls.append((time.perf_counter() - wall) * 1e6)
        cpus.append((time.thread_time() - cpu) * 1e6)
    return walls, cpus, error


def energy_and_fields(args: argparse.Namespace) -> dict[str, Any]:
    """(c) the energy counter both ways; (d) each field of the batch alone; (e) event wait."""
    client = make_client(args.nvml_replay)
    client.init()
    out: dict[str, Any] = {"energy": {}, "fields": [], "event_wait": {}}
    try:
        dev = client.device(0)
        batch = steady_fields()

        def energy_field() -> object:
            answer = dev.field_values([(FI_ENERGY, 0)])[(FI_ENERGY, 0)]
            if isinstance(answer, NvmlError):
                raise answer
            return answer

        cases: dict[str, Callable[[], object]] = {
            "nvmlDeviceGetTotalEnergyConsumption": lambda: dev.call("total_energy_consumption"),
            f"field values: {FI_ENERGY} alone": energy_field,
            "field values: the poll's batch": lambda: dev.field_values(batch),
            "field values: the poll's batch + energy": lambda: dev.field_values(
                [*batch, (FI_ENERGY, 0)]
            ),
        }
        for label, fn in cases.items():
            walls, cpus, error = timed_n(args.polls, fn)
            out["energy"][label] = {
                "wall_us": summary(walls),
                "cpu_us": summary(cpus),
                "error": error,
            }
        values: dict[str, object] = {}
        getters: dict[str, Callable[[], object]] = {
            "call": lambda: dev.call("total_energy_consumption"),
            "field": energy_field,
        }
        for label, get in getters.items():
            try:
                values[label] = get()
            except NvmlError as exc:
                values[label] = exc.code
        out["energy"]["values_mJ"] = values
        for key in batch:

            def one(key: FieldKey = key) -> object:
                answer = dev.field_values([key])[key]
                if isinstance(answer, NvmlError):
                    raise answer
                return answer

            walls, cpus, error = timed_n(args.polls, one)
            out["fields"].append(
                {
                    "field": f"{key[0]}@{key[1]}",
                    "wall_us": summary(walls),
                    "cpu_us": summary(cpus),
                    "error": error,
                }
            )
        out["fields"].sort(key=lambda r: -r["wall_us"]["p50"])
        if args.event_wait > 0:
            events = client.xid_events([dev])
            try:
                waits, spent = 0, []
                deadline = time.monotonic() + args.event_wait
                while time.monotonic() < deadline:
                    wall, cpu = time.perf_counter(), time.thread_time()
                    events.wait(min(5.0, max(0.0, deadline - time.monotonic())))
                    spent.append(
                        ((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e6)
                    )
                    waits += 1
            finally:
                events.close()
            out["event_wait"] = {
                "waits": waits,
                "wall_ms": summary([w for w, _ in spent]),
                "cpu_us": summary([c for _, c in spent]),
            }
    finally:
        release = getattr(locals().get("dev"), "release", None)
        if callable(release):
            release()
        client.shutdown()
    return out


def environment(replay: str) -> dict[str, Any]:
    client = make_client(replay)
    env: dict[str, Any] = {"nvml": replay or "real NVML", "python": platform.python_version()}
    try:
        client.init()
        for name in ("driver_version", "device_count"):
            env[name] = client.call(name)
        env["gpu"] = client.device(0).call("name")
        client.shutdown()
    except NvmlError as exc:
        env["error"] = exc.code
    return env


def _us(r: Mapping[str, Any]) -> str:
    w, c = r["wall_us"], r["cpu_us"]
    return f"{w['p50']:9.1f} {w['p95']:9.1f} {c['p50']:9.1f} {c['p95']:9.1f}"


def print_table(result: dict[str, Any]) -> None:
    """The figures as plain text tables (times in us unless marked ms)."""
    a, polls = result["per_call"], result["polls"]
    head = f"{'wall p50':>9s} {'p95':>9s} {'cpu p50':>9s} {'p95':>9s}"
    print(f"# {result['environment']}")
    print(f"\n(a) each call, {polls} steady polls (us)")
    print(f"{'call':34s} {'gpu':>3s} {head}  cadence")
    total = 0.0
    for r in a["rows"]:
        total += r["wall_us"]["mean"] * r["count"] / max(1, polls)
        note = f"{r['cadence']} {r['error']}".strip()
        print(f"{r['call']:34s} {r['gpu']:3d} {_us(r)}  {note}")
    print(f"calls per poll, summed means: {total / 1e3:.2f} ms")
    print(f"poll wall p50 {a['poll_wall_ms']['p50']} ms, CPU p50 {a['poll_cpu_ms']['p50']} ms")
    print("\n(b) whole steady poll, all GPUs (ms)")
    print(f"{'':34s}     {head}")
    for label, b in result["full_polls"].items():
        w, c = b["wall_ms"], b["cpu_ms"]
        row = f"{w['p50']:9.2f} {w['p95']:9.2f} {c['p50']:9.2f} {c['p95']:9.2f}"
        print(f"{label:34s}     {row}")
    e = result["energy_and_fields"]
    print("\n(c) total energy (us)")
    print(f"{'':54s} {head}")
    for label, r in e["energy"].items():
        if label != "values_mJ":
            print(f"{label:54s} {_us(r)}  {r['error']}")
    print(f"values (mJ): {e['energy']['values_mJ']}")
    print("\n(d) each field of the batch alone (us)")
    print(f"{'':58s} {head}")
    for r in e["fields"]:
        print(f"{r['field']:58s} {_us(r)}  {r['error']}")
    if e["event_wait"]:
        w = e["event_wait"]
        print(
            f"\n(e) Xid event wait: {w['waits']} waits, wall p50 {w['wall_ms']['p50']} ms,"
            f" CPU p50 {w['cpu_us']['p50']} us"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--polls", type=int, default=30, help="polls (and calls) per figure")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between polls")
    ap.add_argument("--event-wait", type=float, default=10.0, help="seconds of Xid event waits")
    ap.add_argument("--nvml-replay", default="", help="a capture instead of the real NVML")
    ap.add_argument("--out", default="", help="write the JSON here")
    args = ap.parse_args(argv)
    env = environment(args.nvml_replay)
    if not env.get("device_count"):
        print(json.dumps({"error": "no GPU", "environment": env}))
        return 2
    try:
        result = {
            "environment": env,
            "polls": args.polls,
            "per_call": per_call(args),
            "full_polls": full_polls(args),
            "energy_and_fields": energy_and_fields(args),
        }
    except SourceError as exc:
        print(json.dumps({"error": str(exc), "environment": env}))
        return 1
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
