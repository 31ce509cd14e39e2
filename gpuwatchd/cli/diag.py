"""`gpuwatchd diag`: active GPU checks (quick, standard, dcgm) with Nagios exit codes.

The CUDA work runs in a worker process (`python -m gpuwatchd.diag.worker`,
from the `gpuwatchd[diag]` extra or any interpreter with CuPy or PyTorch:
`--python`); this process reads NVML and compares each figure with its
floor. Exit 0 OK, 2 CRITICAL (a check failed), 3 UNKNOWN (a check could
not run or reported nothing, a GPU named with --gpu does not exist, the
node was busy, the run was cancelled or interrupted, or a usage error),
78 a bad config, floors file or capture.

Every run is recorded in the daemon's event store (`--state-dir`, else
$GPUWATCHD_STATE_DIR, else daemon.state_dir) with trigger `cli` when the
command ends, by the command context, so the daemon exports it and
GpuDiagFailed sees it; a state dir that cannot take it is said on stderr and
changes nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.command import add_state_dir, plugin_command, seconds
from gpuwatchd.config import Config
from gpuwatchd.diag.run import DiagOptions, open_nvml, options_for, run_diag
from gpuwatchd.errors import ConfigError, GpuwatchdError
from gpuwatchd.model import DiagRun
from gpuwatchd.sinks.diag import PendingRun
from gpuwatchd.sources.diag.runner import WorkerRun

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["Interrupted", "register", "render_text", "stop_worker_on_signals"]

EXIT = {"OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(GpuwatchdError):
    """A stop signal arrived while no worker was running (reading NVML, running dcgmi)."""


@contextlib.contextmanager
def stop_worker_on_signals() -> Iterator[Callable[[WorkerRun], None]]:
    """While a run lasts, SIGINT, SIGTERM and SIGHUP kill the worker's whole group.

    Yields the `on_start` hook for run_diag. A signal during the worker
    cancels the run (reported UNKNOWN, "interrupted by SIGTERM"); one outside
    it raises Interrupted. The worker runs in its own session, so a Slurm
    prolog timeout, a `timeout` wrapper or Ctrl-C reach it only through here.
    """
    worker: list[WorkerRun] = []
    why: list[str] = []

    def started(run: WorkerRun) -> None:
        worker.append(run)
        if why:
            run.cancel(why[0])

    def stop(signum: int, _frame: FrameType | None) -> None:
        why.append(f"interrupted by {signal.Signals(signum).name}")
        if not worker:
            raise Interrupted(why[0])
        worker[-1].cancel(why[0])  # kills the group now; run_diag reports the cancel

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield started
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def register(subparsers: Any) -> None:
    """Add the `diag` subcommand."""
    p = subparsers.add_parser(
        "diag",
        help="active GPU checks on an idle node (exit 0 OK, 2 CRITICAL, 3 UNKNOWN)",
        description="Run GEMM, copy, NCCL and memory checks against per-model floors "
        "(docs/diag.md). Refuses to run while a process uses a GPU.",
    )
    plugin_command(p)  # a usage error is UNKNOWN (3), never CRITICAL (2)
    p.add_argument("--tier", choices=("quick", "standard", "dcgm"), default="quick")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--gpu", type=_index, action="append", default=[], metavar="N", help="only GPU N (repeat)"
    )
    p.add_argument("--config", metavar="FILE", help="YAML config (its diag section)")
    p.add_argument("--python", metavar="EXE", help="interpreter with CuPy or PyTorch")
    p.add_argument("--backend", choices=("auto", "cupy", "torch"), help="GPU library")
    p.add_argument("--floors", metavar="FILE", help="site floors, matched before the shipped ones")
    p.add_argument("--timeout", type=seconds, metavar="S", help="give up after S seconds (> 0)")
    p.add_argument("--dcgm-level", type=int, choices=(1, 2, 3, 4), help="dcgmi diag -r N")
    p.add_argument("--nvml-replay", metavar="FILE", help="replay a recorded NVML capture")
    add_state_dir(p, "the daemon's event store, where the run is recorded")
    p.add_argument("--fake-worker", metavar="FILE", help=argparse_suppress())
    p.set_defaults(func=_run_diag)


def argparse_suppress() -> str:
    """Hidden options (test-only worker mode) carry no help."""
    return argparse.SUPPRESS


def _index(text: str) -> int:
    """argparse type: a GPU index, a whole number >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a GPU index (0, 1, ...): {text!r}")
    return int(text)


def options_from(args: Any, cfg: Config | None = None) -> DiagOptions:
    """DiagOptions from the config's diag section, then the command line (floors checked)."""
    from gpuwatchd import config
    from gpuwatchd.config.floors import load_floors

    base = options_for(cfg or config.load(args.config), args.tier, args.gpu)
    if args.floors:
        load_floors(args.floors)  # a bad file: exit 78 now, not after the GPU work
    return dataclasses.replace(
        base,
        python=args.python or base.python,
        backend=args.backend or base.backend,
        timeout=args.timeout or base.timeout,
        dcgm_level=args.dcgm_level or base.dcgm_level,
        floors_file=args.floors or base.floors_file,
        fake_worker=args.fake_worker or base.fake_worker,
    )


def _run_diag(ctx: CommandContext) -> int:
    args = ctx.args
    cfg = ctx.config
    opts = options_from(args, cfg)
    try:
        client = open_nvml(cfg, args.nvml_replay or "")
    except ConfigError:
        raise  # a capture that is not one: exit 78 naming it
    except Exception as exc:
        print(f"UNKNOWN: NVML: {exc}")
        return EXIT["UNKNOWN"]
    try:
        with stop_worker_on_signals() as on_start:
            report = run_diag(opts, client, on_start=on_start)
    except Interrupted as exc:
        print(f"UNKNOWN: diag {opts.tier} {exc}")
        return EXIT["UNKNOWN"]
    finally:
        try:
            client.shutdown()
        except Exception:
            pass
    ctx.done(PendingRun(report))  # into the daemon's store when the command ends (trigger cli)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        sys.stdout.write(render_text(report))
    return EXIT.get(report.verdict, 3)


def _num(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-" if value is None else str(value)
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.2f}"


def render_text(report: DiagRun) -> str:
    """The report for a human: verdict line, one line per result, floor sources below."""
    head = f"{report.verdict}: diag {report.tier}"
    if report.cancelled:
        head += f" cancelled ({report.cancelled})"
    else:
        failed = [r for r in report.results if r.outcome == "fail"]
        head += f", {len(report.results)} results, {len(failed)} failed"
    head += f" in {report.seconds:.1f}s" + (f" [{report.backend}]" if report.backend else "")
    lines = [head]
    if report.error:
        lines.append(f"  error: {report.error}")
    sources: list[str] = []
    for r in report.results:
        mark = ""
        if r.floor is not None:
            if r.floor_source not in sources:
                sources.append(r.floor_source)
            mark = f" (floor {_num(r.floor)} [{sources.index(r.floor_source) + 1}])"
        lines.append(
            f"  {r.outcome.upper():9} {r.check:15} gpu {r.gpu:5} {_num(r.measured):>8} "
            f"{r.unit}{mark}  {r.detail}"
        )
    for i, source in enumerate(sources, 1):
        lines.append(f"  [{i}] {source}")
    return "\n".join(lines) + "\n"
