"""One `gpuwatchd diag` run: NVML before, the worker (or dcgmi), NVML after, verdicts.

Shared by the command line and the daemon's scheduled and pre-resume runs.
The run refuses to start on a busy GPU and is cancelled, not failed, when a
process other than the worker appears on a GPU or `busy()` names a job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuwatchd.config import Config
from gpuwatchd.diag.worker.measure import Measurement, worker_results
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.diag.verdict import evaluate, load_floors, verdict
from gpuwatchd.model import DiagRun
from gpuwatchd.sinks.diag import record_run, repeat_offenders
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources.diag.dcgm import run_dcgmi
from gpuwatchd.sources.diag.nvml_reads import (
    GpuSnapshot,
    counter_checks,
    foreign_pids,
    read_gpus,
    sanity_checks,
)
from gpuwatchd.sources.diag.runner import WorkerRun, worker_command
from gpuwatchd.sources.nvml.client import NvmlClient

__all__ = [
    "DiagOptions",
    "FAKE_WORKER_ENV",
    "open_nvml",
    "options_for",
    "run_diag",
    "run_recorded",
]

# Test only: a canned worker script (the worker's --fake mode) instead of the GPU work.
FAKE_WORKER_ENV = "GPUWATCHD_DIAG_FAKE_WORKER"

Busy = Callable[[], str]  # why the node is busy (a job, a pod), or ""


@dataclass(frozen=True)
class DiagOptions:
    """What to run and how."""

    tier: str = "quick"
    gpus: tuple[int, ...] = ()
    python: str = ""  # the interpreter with CuPy or PyTorch; default: this one
    backend: str = "auto"
    timeout: float = 300.0
    dcgm_level: int = 2
    floors_file: str = ""
    fake_worker: str = ""  # test only: canned measurements instead of a GPU


def options_for(cfg: Config, tier: str, gpus: Sequence[int] = ()) -> DiagOptions:
    """DiagOptions from the config's diag section."""
    d = cfg.diag
    return DiagOptions(
        tier=tier,
        gpus=tuple(dict.fromkeys(gpus)),
        python=d.python,
        backend=d.backend,
        timeout=d.timeout_seconds,
        dcgm_level=d.dcgm_level,
        floors_file=d.floors_file,
        fake_worker=os.environ.get(FAKE_WORKER_ENV, ""),
    )


def open_nvml(cfg: Config, replay: str = "") -> NvmlClient:
    """An initialised NVML client: the capture `replay` (or sources.nvml.replay), else NVML."""
    path = replay or cfg.sources.nvml.replay
    client: NvmlClient
    if path:
        from gpuwatchd.sources.nvml.replay import ReplayClient

        try:
            client = ReplayClient.load(path)
        except (OSError, ValueError) as exc:  # a bad file named, not a broken GPU
            key = "--nvml-replay" if replay else "sources.nvml.replay"
            raise ConfigError("command line" if replay else "", key, f"{path}: {exc}") from None
    else:
        from gpuwatchd.sources.nvml.client import Pynvml

        client = Pynvml()
    client.init()
    return client


def _cancelled(opts: DiagOptions, t0: float, wall: float, why: str, **kw: Any) -> DiagRun:
    return DiagRun(opts.tier, wall, time.monotonic() - t0, "UNKNOWN", cancelled=why, **kw)


def run_diag(
    opts: DiagOptions,
    client: NvmlClient,
    busy: Busy | None = None,
    on_start: Callable[[WorkerRun], None] | None = None,
) -> DiagRun:
    """Run one tier on this node's GPUs (NVML already initialised)."""
    t0, wall = time.monotonic(), time.time()
    floors = load_floors(opts.floors_file)  # a bad site file stops the run before GPU work
    absent = _absent_gpus(client, opts.gpus)
    if absent:  # a GPU that is not there was not measured: UNKNOWN, never CRITICAL
        return DiagRun(opts.tier, wall, time.monotonic() - t0, "UNKNOWN", error=absent)
    before = read_gpus(client, opts.gpus)
    models = {str(g.index): g.name for g in before if g.name}
    buses = {str(g.index): g.pci_bus_id for g in before if g.pci_bus_id}
    gpus = tuple(str(g.index) for g in before)
    why = _busy_now(before, None, busy)
    if why:
        return _cancelled(opts, t0, wall, why, gpus=gpus, models=models, buses=buses)
    measurements: list[Measurement] = sanity_checks(before)
    backend, error, freed = "", "", 0.0
    if opts.tier == "dcgm":
        measurements.append(run_dcgmi(opts.dcgm_level, opts.timeout))
    else:
        runnable = [g.index for g in before if not g.error]
        worker = WorkerRun(
            worker_command(
                opts.tier,
                runnable,
                opts.python,
                opts.backend,
                opts.fake_worker,
            ),
            opts.timeout,
            should_cancel=lambda pid: _busy_now(read_gpus(client, opts.gpus), pid, busy),
        )
        if on_start is not None:
            on_start(worker)
        outcome = worker.run()
        if outcome.cancelled:
            return _cancelled(
                opts,
                t0,
                wall,
                outcome.cancelled,
                gpus=gpus,
                models=models,
                freed_seconds=outcome.freed_seconds,
                backend=outcome.backend,
            )
        backend, error, freed = outcome.backend, outcome.error, outcome.freed_seconds
        measurements += outcome.measurements
        if opts.tier == "standard":
            measurements += counter_checks(before, read_gpus(client, opts.gpus))
        measurements += _missing(opts.tier, measurements, [str(i) for i in runnable], error)
    results = tuple(evaluate(measurements, models, floors))
    return DiagRun(
        opts.tier,
        wall,
        time.monotonic() - t0,
        verdict(results),
        results,
        backend,
        error=error,
        gpus=gpus,
        freed_seconds=freed,
        models=models,
        buses=buses,
    )


def _busy_now(gpus: Sequence[GpuSnapshot], worker_pid: int | None, busy: Busy | None) -> str:
    pids = foreign_pids(gpus, worker_pid)
    if pids:
        return "GPU in use by process " + ", ".join(str(p) for p in pids[:5])
    return busy() if busy is not None else ""


def _absent_gpus(client: NvmlClient, wanted: Sequence[int]) -> str:
    """Why `wanted` names a GPU NVML does not have (naming those it has), or ""."""
    if not wanted:
        return ""
    count = client.call("device_count")
    count = count if isinstance(count, int) else 0
    absent = sorted({g for g in wanted if not 0 <= g < count})
    if not absent:
        return ""
    have = f"GPUs {', '.join(map(str, range(count)))}" if count else "no GPU"
    return f"no GPU {', '.join(map(str, absent))} on this node (NVML sees {have})"


def _missing(
    tier: str, got: Sequence[Measurement], gpus: Sequence[str], error: str
) -> list[Measurement]:
    """An error result for each check of the tier the worker never reported.

    A worker that says hello and done, or stops reporting one GPU, measured
    nothing there: the run must be UNKNOWN, not OK.
    """
    seen = {(m.check, m.gpu) for m in got}
    why = error or "not reported by the diag worker"
    return [
        Measurement(check, gpu, None, "", error=why)
        for check, gpu in worker_results(tier, gpus)
        if (check, gpu) not in seen
    ]


def run_recorded(
    cfg: Config,
    store: EventStore,
    tier: str,
    trigger: str,
    busy: Busy | None = None,
    on_start: Callable[[WorkerRun], None] | None = None,
) -> tuple[DiagRun, list[tuple[str, str]]]:
    """Run `tier` with the config's options, store it; also the repeat offenders after it."""
    try:
        client = open_nvml(cfg)
    except Exception as exc:  # no driver, no pynvml: nothing ran, nothing failed
        t = time.time()
        return DiagRun(tier, t, 0.0, "UNKNOWN", error=f"NVML: {exc}"), []
    try:
        report = run_diag(options_for(cfg, tier), client, busy, on_start)
    finally:
        try:
            client.shutdown()
        except Exception:
            pass
    report = replace(report, trigger=trigger)
    record_run(store, report)
    offenders = repeat_offenders(store, time.time(), cfg.diag.inspect_after_failures)
    return report, offenders
