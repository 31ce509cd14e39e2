"""`gpuwatchd check`: a one-shot health verdict from the daemon's own pipeline.

`check` builds the sources and the consumer chain with the daemon's
wiring (gpuwatchd/pipeline/), polls every enabled source once in its own
thread under one overall deadline, so a hung NVML cannot block it; the
kernel log source reads what the ring buffer holds for this boot. The
chain runs one-shot (without `for:` delays: the check reports what is true
now) over the daemon's store, read and never written. It exits with the
monitoring-plugin convention: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (a
source could not be read). `--format npd`
follows node-problem-detector's custom plugin contract: 0 OK, 1 problem,
2 unknown, one short line.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwatchd import config
from gpuwatchd.cli.command import PLUGIN_USAGE, add_state_dir, plugin_command, seconds
from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.config import Config
from gpuwatchd.config.overrides import node_name
from gpuwatchd.errors import GpuwatchdError
from gpuwatchd.health import alerts
from gpuwatchd.health.hangs.stored import open_hangs
from gpuwatchd.health.rollup import finding_json
from gpuwatchd.model import Finding, Severity, SourceSnapshot
from gpuwatchd.runmarker import EVENT_KIND as RESTART
from gpuwatchd.sources import Source
from gpuwatchd.sources.runner import Runner
from gpuwatchd.sources.workloads.source import workloads_on_gpus
from gpuwatchd.state import State

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["Verdict", "check", "collect", "register"]

HANG_LOOKBACK_SECONDS = 86400.0  # an open hang older than a day is taken as stale

log = logging.getLogger("gpuwatchd.check")

EXIT = {"OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}
NPD_MAX = 80  # node-problem-detector's default max_output_length
SKIPPED = frozenset({"udev"})  # only nudges other sources; nothing to check once
AFTER_NVML = frozenset({"workloads"})


def register(subparsers: Any) -> None:
    """Add the `check` subcommand."""
    p = subparsers.add_parser(
        "check",
        help="one-shot node health check (exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN)",
        description="Poll every source once, evaluate the health rules, print what is wrong "
        "and what to do first. For Slurm prolog/epilog, node health checks, probes, humans.",
    )
    plugin_command(p)  # a usage error is UNKNOWN (3), never CRITICAL (2)
    p.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults)")
    p.add_argument("--nvml-replay", metavar="FILE", help="replay a recorded NVML capture")
    add_state_dir(p, "the daemon's store, read for clears, baseline and Xids")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument(
        "--format",
        choices=("text", "json", "npd"),
        help="text (default), json, or npd: node-problem-detector custom plugin"
        " (exit 0 OK, 1 problem, 2 unknown; one line)",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="S",
        help="overall deadline in seconds (default 30)",
    )
    p.add_argument(
        "--npd-problem",
        choices=("warning", "critical"),
        default="critical",
        help="lowest severity that counts as a problem for --format npd",
    )
    p.set_defaults(func=_run_check)


# --- collecting ------------------------------------------------------------------


@dataclass
class Polled:
    """What one source gave within the deadline."""

    name: str
    snapshot: SourceSnapshot | None = None
    error: str = ""

    @property
    def readable(self) -> bool:
        snap = self.snapshot
        reader = snap.kmsg if snap is not None else None
        return (
            snap is not None and snap.ok and not self.error and (reader is None or reader.reader_up)
        )

    def describe(self) -> str:
        snap = self.snapshot
        if self.error:
            return self.error
        if snap is None:
            return "no answer"
        if not snap.ok:
            return f"failed: {snap.error}"
        if snap.kmsg is not None and not snap.kmsg.reader_up:
            return f"cannot read: {snap.kmsg.error or 'reader down'}"
        return f"ok ({snap.duration_seconds:.2f}s)"


@dataclass
class Collected:
    state: State
    polled: dict[str, Polled]


def collect(
    cfg: Config,
    clock: Clock,
    timeout: float,
    only: Sequence[str] | None = None,
    state: State | None = None,
) -> Collected:
    """Build the enabled sources as the daemon does and poll each once, in parallel,
    within `timeout`; what they publish goes to `state` (and its listeners)."""
    from gpuwatchd.pipeline import SourceSet  # late: every source module comes with it

    deadline = clock.monotonic() + timeout
    state = state if state is not None else State()
    out = Collected(state, {})
    sources: list[SourceSet] = []
    _within(lambda: sources.append(SourceSet(cfg, state, clock, one_shot=True)), deadline, clock)
    runner = sources[0].runner
    built = [
        s for s in runner.sources if s.name not in SKIPPED and (only is None or s.name in only)
    ]
    # The workloads source reads NVML's processes: it polls once NVML has.
    late = [s for s in built if s.name in AFTER_NVML]
    threads: list[tuple[threading.Thread, Polled]] = []

    def start(source: Any) -> None:
        polled = out.polled[source.name] = Polled(source.name)
        t = threading.Thread(
            target=_poll,
            args=(runner, source, polled, deadline, clock),
            name=f"check-{source.name}",
            daemon=True,
        )
        t.start()
        threads.append((t, polled))

    for source in built:
        if source.name not in AFTER_NVML:
            start(source)
    for t, _ in threads if late else ():
        t.join(max(0.0, deadline - clock.monotonic()))
    for source in late:
        start(source)
    for t, polled in threads:
        t.join(max(0.0, deadline - clock.monotonic()))
        if t.is_alive():
            polled.error = f"no answer within {timeout:g}s"
        if polled.snapshot is None:
            # The rules must see the source as failing (e.g. NVML hung with GPUs expected).
            state.publish(SourceSnapshot(polled.name, (), False, "timeout", timestamp=clock.time()))
    for source in runner.sources:
        if source.name not in out.polled or out.polled[source.name].snapshot is not None:
            _close_quietly(source)
    return out


def _within(fn: Any, deadline: float, clock: Clock) -> None:
    """Run `fn` on a thread; give up at the deadline; re-raise what it raised."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=run, name="check-build", daemon=True)
    t.start()
    t.join(max(0.0, deadline - clock.monotonic()))
    if t.is_alive():
        raise GpuwatchdError("building the sources did not finish before the deadline")
    if failure:
        raise failure[0]


def _poll(runner: Runner, source: Source, polled: Polled, deadline: float, clock: Clock) -> None:
    try:
        snap = runner.poll_once(source.name)
        if source.name == "kmsg":
            # Read what the ring buffer holds now: poll until a poll reads nothing new.
            before = -1
            while _read(snap) != before and clock.monotonic() < deadline:
                before = _read(snap)
                snap = runner.poll_once(source.name)
        polled.snapshot = snap
    except Exception as exc:  # a bug in a source must not end the check
        polled.error = f"{type(exc).__name__}: {exc}"


def _read(snap: SourceSnapshot) -> int:
    return snap.kmsg.records_read if snap.kmsg is not None else 0


def _close_quietly(source: Source) -> None:
    try:
        source.close()
    except Exception:
        log.debug("closing %s", source.name, exc_info=True)


# --- evaluating ------------------------------------------------------------------


@dataclass
class Verdict:
    """The outcome of one check."""

    status: str  # OK, WARNING, CRITICAL, UNKNOWN
    findings: list[Finding]
    polled: dict[str, Polled]
    node: str
    gpus: int
    notes: list[str] = field(default_factory=list)
    workloads: list[dict[str, object]] = field(default_factory=list)  # on unhealthy GPUs
    topology: dict[str, object] | None = None  # GPU links, NUMA, CPUs, nearest NICs
    diag: list[dict[str, object]] = field(default_factory=list)  # the last stored diag run

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]


def check(cfg: Config, clock: Clock | None = None, timeout: float = 30.0) -> Verdict:
    """Collect, evaluate and judge; never raises for a source that misbehaves.

    The chain is the daemon's (`pipeline.Consumers`), one-shot: no `for:`
    delays, and the daemon's store (under daemon.state_dir) read, never
    written: its operator clears, GPU count baseline and Xids of this boot.
    """
    from gpuwatchd.app import Mode, assemble
    from gpuwatchd.pipeline import open_store_reader

    clock = clock or SystemClock()
    notes: list[str] = []
    state = State()
    store = open_store_reader(cfg, notes)
    diag: list[dict[str, object]] = []
    try:
        chain = assemble(Mode.CHECK, cfg, state, clock, store=store)
        if store is not None:  # the last diag results count like the daemon's (GpuDiagFailed)
            diag = _stored_diag(cfg, store.event_store(), state, clock.time())
        got = collect(cfg, clock, timeout, state=state)
        chain.drain()
        snap = state.snapshot()
        stamps = [s.timestamp for s in snap.sources.values() if s.timestamp]
        findings = chain.engine.evaluate(snap, now=max(stamps, default=clock.time()))
        if store is not None:  # job hangs the running daemon holds open (its own memory)
            stored = store.events_since(clock.time() - HANG_LOOKBACK_SECONDS)
            findings += open_hangs(stored)
            notes += [f"gpuwatchd restarted: {e.message}" for e in stored if e.kind == RESTART]
    finally:
        if store is not None:
            store.close()
    worst = max((f.severity for f in findings), default=Severity.OK)
    unreadable = [p for p in got.polled.values() if not p.readable]
    if worst >= Severity.CRITICAL:
        status = "CRITICAL"
    elif unreadable:
        status = "UNKNOWN"
    elif worst >= Severity.WARNING:
        status = "WARNING"
    else:
        status = "OK"
    verdict = Verdict(status, findings, got.polled, node_name(cfg), chain.engine.gpu_count(), notes)
    nvml = snap.sources.get("nvml")
    if nvml is not None and nvml.inventory is not None and nvml.inventory.topology is not None:
        verdict.topology = nvml.inventory.topology.as_json()
    verdict.diag = diag
    held = snap.sources.get("workloads")
    if held is not None and held.workloads is not None:
        gpus = [v for f in findings if f.severity >= Severity.WARNING for _, v in f.subject]
        verdict.workloads = workloads_on_gpus(held.workloads.current, gpus)
    return verdict


def _stored_diag(cfg: Config, es: Any, state: State, now: float) -> list[dict[str, object]]:
    from gpuwatchd.diag.scheduler import diag_samples
    from gpuwatchd.sinks.diag import last_runs

    state.publish_extra("diag", diag_samples(es, now, cfg.diag.inspect_after_failures))
    return [r.to_json() for r in last_runs(es, 1)]


# --- output ----------------------------------------------------------------------


def render_text(v: Verdict, cfg: Config) -> str:
    """The human report: verdict, what to do first, each condition, the sources."""
    crit = sum(f.severity >= Severity.CRITICAL for f in v.findings)
    warn = sum(f.severity == Severity.WARNING for f in v.findings)
    lines = [
        f"gpuwatchd check: {v.status} - {crit} critical, {warn} warning "
        f"(node {v.node}, {v.gpus} GPU(s))"
    ]
    if v.findings:
        first = v.findings[0]
        lines.append(f"First: {first.remediation or alerts.summary(first)}")
    elif v.status == "UNKNOWN":
        lines.append("First: find out why a source could not be read (see below).")
    base = cfg.alertmanager.runbook_base_url.rstrip("/") or "docs/runbooks"
    for f in v.findings:
        subject = dict(f.subject)
        bus = f" ({subject['pci_bus_id']})" if subject.get("pci_bus_id") else ""
        where = (
            f"GPU {subject['gpu']}{bus}"
            if subject.get("gpu")
            else ", ".join(f"{k}={val}" for k, val in f.subject if val) or "node"
        )
        lines += [
            "",
            f"  {str(f.severity).upper():<9}{f.alertname}  {where}",
            f"           {f.reason}",
            f"           do: {f.remediation or '-'}",
            f"           action: {f.action}   runbook: {base}/{f.alertname}.md",
        ]
    if v.workloads:
        lines += ["", "On these GPUs: " + "; ".join(_workload_line(w) for w in v.workloads)]
    lines.append("")
    lines.append("Sources: " + "; ".join(f"{p.name} {p.describe()}" for p in v.polled.values()))
    lines.extend(f"Note: {n}" for n in v.notes)
    return "\n".join(lines) + "\n"


def _workload_line(w: Mapping[str, object]) -> str:
    """pod ml/train-0, Slurm job 12 (bert, alice), torch job ... or pid 4242, with processes."""
    if w.get("pod"):
        who = f"pod {w.get('namespace')}/{w.get('pod')}"
    elif w.get("kind") == "k8s":
        who = f"pod uid {w.get('pod_uid')}"
    elif w.get("slurm_job"):
        extra = ", ".join(str(w[k]) for k in ("slurm_job_name", "slurm_user") if w.get(k))
        who = f"Slurm job {w['slurm_job']}" + (f" ({extra})" if extra else "")
    elif w.get("kind") == "torch":
        who = f"torch job {w.get('id')}"
    else:
        who = f"pid {w.get('id')}"
    procs = w.get("processes")
    pids = (
        [str(p.get("pid")) for p in procs if isinstance(p, dict)] if isinstance(procs, list) else []
    )
    return who + (f" [pids {', '.join(pids)}]" if pids else "")


def render_json(v: Verdict) -> str:
    data = {
        "status": v.status,
        "exit_code": v.exit_code,
        "node": v.node,
        "gpus": v.gpus,
        "conditions": [finding_json(f) for f in v.findings],
        "workloads": v.workloads,
        "diag": v.diag,
        "sources": {
            p.name: {"readable": p.readable, "detail": p.describe()} for p in v.polled.values()
        },
        "notes": v.notes,
        "topology": v.topology,
    }
    return json.dumps(data, indent=1) + "\n"


def render_npd(v: Verdict, problem: Severity) -> tuple[int, str]:
    """node-problem-detector: (exit 0 OK / 1 problem / 2 unknown, one short line)."""
    bad = [f for f in v.findings if f.severity >= problem]
    if bad:
        f = bad[0]
        more = f"; +{len(bad) - 1} more" if len(bad) > 1 else ""
        return 1, f"{f.alertname}: {alerts.summary(f)}{more}"[:NPD_MAX]
    if v.status == "UNKNOWN":
        names = ",".join(p.name for p in v.polled.values() if not p.readable)
        return 2, f"cannot read: {names}"[:NPD_MAX]
    return 0, f"healthy: {v.gpus} GPU(s)"


def _run_check(ctx: CommandContext) -> int:
    args = ctx.args
    if args.json and args.format not in (None, "json"):
        print(
            "gpuwatchd check: --json means --format json;"
            f" it cannot go with --format {args.format}",
            file=sys.stderr,
        )
        return PLUGIN_USAGE
    fmt = args.format or ("json" if args.json else "text")
    cfg = ctx.config
    config.check_paths(cfg, args.config or "<defaults>")
    try:
        verdict = check(cfg, timeout=args.timeout)
    except GpuwatchdError as exc:
        verdict = Verdict("UNKNOWN", [], {}, node_name(cfg), 0, [str(exc)])
    if fmt == "npd":
        code, line = render_npd(verdict, Severity.parse(args.npd_problem))
        print(line)
        return code
    sys.stdout.write(render_json(verdict) if fmt == "json" else render_text(verdict, cfg))
    return verdict.exit_code


# --- clear -----------------------------------------------------------------------
