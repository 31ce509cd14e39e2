"""`gpuwatchd clear`: record an operator clear of sticky conditions in the event store."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from gpuwatchd.bootid import read_boot_id
from gpuwatchd.cli.check import collect
from gpuwatchd.cli.command import EX_USAGE, add_state_dir
from gpuwatchd.clock import SystemClock
from gpuwatchd.config import Config
from gpuwatchd.config.overrides import node_name
from gpuwatchd.errors import GpuwatchdError
from gpuwatchd.model import Severity
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sinks.store import DB_NAME, EventStore

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["operator", "register", "resolve_gpu"]

OPEN_CHECK_SECONDS = 30.0  # the one-shot check before a resume, as `gpuwatchd check`
CRITICAL_EXIT = 2  # refused: a critical condition is open (the check convention)


def register(subparsers: Any) -> None:
    """Add the `clear` subcommand."""
    c = subparsers.add_parser(
        "clear",
        help="clear sticky conditions (critical Xids, ECC, lost GPUs) after fixing them",
        description="Record an operator clear (who, when, why) in the event store. The running"
        " daemon applies it within a few seconds.",
    )
    which = c.add_mutually_exclusive_group()
    which.add_argument("--gpu", metavar="N|UUID|BUS_ID", help="the GPU to clear")
    which.add_argument("--all", action="store_true", help="every GPU (and the GPU count)")
    c.add_argument("--xid", type=int, metavar="CODE", help="only this Xid code")
    c.add_argument("--reason", default="", help="why (kept with the clear)")
    c.add_argument(
        "--resume",
        action="store_true",
        help="undo remediation: resume the Slurm node gpuwatchd drained, set GpuHealthy=True,"
        " remove the taint",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="with --resume: resume although a critical condition is still open, and skip"
        " the diag standard run that must pass first (recorded)",
    )
    c.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults)")
    add_state_dir(c, "the daemon's event store")
    c.add_argument(
        "--new-store",
        action="store_true",
        help="start an event store if the state dir has none (a node that runs only `check`)",
    )
    c.set_defaults(func=_run_clear)


def operator() -> str:
    """Who runs the command: the sudo caller if any."""
    return os.environ.get("SUDO_USER") or os.environ.get("USER") or getpass.getuser()


def resolve_gpu(cfg: Config, target: str, timeout: float = 15.0) -> str:
    """A GPU index or UUID -> its PCI bus id (from stored events, else NVML)."""
    if ":" in target:
        return normalize_bus_id(target) or target.strip().lower()

    path = os.path.join(cfg.daemon.state_dir, DB_NAME)
    if os.path.exists(path):
        store = EventStore.from_config(cfg)
        try:
            rows = store.recent(1, gpu=target)
        finally:
            store.close()
        if rows and rows[0].get("pci_bus_id"):
            bus = str(rows[0]["pci_bus_id"])
            return normalize_bus_id(bus) or bus.strip().lower()
    got = collect(cfg, SystemClock(), timeout, only=["nvml"])
    nvml = got.state.snapshot().sources.get("nvml")
    gpu = nvml.inventory.find(target) if nvml is not None and nvml.inventory else None
    if gpu is not None:
        return gpu.pci_bus_id
    raise GpuwatchdError(
        f"no GPU {target!r} known to NVML or the event store; "
        "pass its PCI bus id (e.g. 0000:3b:00.0)"
    )


def _run_clear(ctx: CommandContext) -> int:
    args: Any = ctx.args
    if not (args.gpu or args.all or args.resume):
        print("gpuwatchd clear: one of --gpu, --all or --resume is required", file=sys.stderr)
        return EX_USAGE
    cfg = ctx.config
    if args.gpu or args.all:
        if not (args.new_store or ctx.has_store()):
            # a clear in a store nobody reads (a mistyped --state-dir) would be lost unseen
            print(
                f"gpuwatchd clear: no event store in {cfg.daemon.state_dir}; pass the daemon's"
                " --state-dir (or set GPUWATCHD_STATE_DIR), or --new-store to start one",
                file=sys.stderr,
            )
            return 1
        _clear_gpus(ctx)
    return _resume(ctx) if args.resume else 0


def _resume(ctx: CommandContext) -> int:
    from gpuwatchd.sinks.remediation.resume import resume

    cfg, args = ctx.config, ctx.args
    node = node_name(cfg)
    store = ctx.store()
    try:
        refused = _verify(cfg, store, args)
        if refused is not None:
            return refused
        lines = resume(cfg, node, store, operator(), args.reason)
        for line in lines or ["nothing to resume: no remediation is configured or in effect"]:
            print(line)
    except GpuwatchdError as exc:
        print(f"gpuwatchd clear --resume: {exc}", file=sys.stderr)
        return 1
    return 0


def _still_critical(cfg: Config, store: EventStore, args: argparse.Namespace) -> int | None:
    """Refuse a resume while a critical condition is open (the daemon would drain again)."""
    from gpuwatchd.cli.check import check
    from gpuwatchd.health import alerts
    from gpuwatchd.sinks.remediation.sink import record

    verdict = check(cfg, timeout=OPEN_CHECK_SECONDS)
    open_now = [
        f"{f.alertname}: {alerts.summary(f)}"
        for f in verdict.findings
        if f.severity >= Severity.CRITICAL
    ]
    if not open_now:
        return None
    what = "; ".join(open_now[:3]) + (f"; +{len(open_now) - 3} more" if len(open_now) > 3 else "")
    if args.force:
        print(f"still open, resuming anyway (--force): {what}")
        return None
    who = operator()
    why = f"a critical condition is still open: {what}"
    record(
        store,
        "all",
        "resume_refused",
        f"not resumed: {why}",
        time.time(),
        who=who,
        reason=args.reason,
    )
    print(
        f"not resumed: {why}. The daemon would take the node out of service again after"
        f" remediation.hold_seconds ({cfg.remediation.hold_seconds:g} s). Fix it and clear it"
        " (gpuwatchd clear --gpu N or --all), or resume anyway with --force.",
        file=sys.stderr,
    )
    return CRITICAL_EXIT


def _verify(cfg: Config, store: EventStore, args: argparse.Namespace) -> int | None:
    """Run diag standard before a resume; None to go ahead, else the exit code."""
    from gpuwatchd.cli.diag import EXIT, Interrupted, render_text, stop_worker_on_signals
    from gpuwatchd.diag.run import run_recorded
    from gpuwatchd.sinks.remediation.sink import engaged_actions, record

    rem = cfg.remediation
    engaged, _ = engaged_actions(store)
    if not (
        engaged or rem.slurm.drain_on or rem.kubernetes.condition_on or rem.kubernetes.taint_on
    ):
        return None  # nothing to resume
    refused = _still_critical(cfg, store, args)
    if refused is not None:
        return refused
    who = operator()
    if args.force:
        record(
            store,
            "all",
            "resume_forced",
            f"resume without diag, forced by {who}",
            time.time(),
            who=who,
            reason=args.reason,
        )
        print("diag skipped (--force); recorded as a forced resume")
        return None
    if not cfg.diag.verify_before_resume:
        return None
    try:
        with stop_worker_on_signals() as on_start:  # the worker never outlives this command
            report, offenders = run_recorded(cfg, store, "standard", "resume", on_start=on_start)
    except Interrupted as exc:
        print(f"not resumed: diag standard {exc}", file=sys.stderr)
        return EXIT["UNKNOWN"]
    sys.stdout.write(render_text(report))
    for check, gpu in offenders:
        print(
            f"drain_and_inspect: {check} failed on GPU {gpu} "
            f"{cfg.diag.inspect_after_failures}+ times in 30 days"
        )
    if report.verdict == "OK":
        return None
    why = report.cancelled or report.error or f"diag standard {report.verdict}"
    record(
        store,
        "all",
        "resume_refused",
        f"not resumed: {why}",
        time.time(),
        who=who,
        reason=args.reason,
    )
    print(f"not resumed: {why} (gpuwatchd clear --resume --force skips the check)", file=sys.stderr)
    return EXIT.get(report.verdict, 3)


def _clear_gpus(ctx: CommandContext) -> None:
    cfg, args = ctx.config, ctx.args
    bus = "" if args.all else resolve_gpu(cfg, args.gpu)
    row = ctx.store().add_clear(
        operator(),
        pci_bus_id=bus,
        code=args.xid,
        reason=args.reason,
        boot_id=read_boot_id(cfg.paths.boot_id),
    )
    what = f"GPU {args.gpu} ({bus})" if bus else "all GPUs"
    if args.xid is not None:
        what += f", Xid {args.xid} only"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.time))
    print(
        f"cleared {what}: recorded as clear #{row.id} by {row.who} at {when}"
        f"{' (' + args.reason + ')' if args.reason else ''}."
    )
    print("A running gpuwatchd applies it within a few seconds.")
