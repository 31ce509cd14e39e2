"""Health rules: pure functions from what we know now to findings.

Each rule is `(view, history, cfg, now) -> list[Finding]`: `view` is the
current NodeSnapshot indexed (history.View), `history` the memory the
engine keeps across evaluations (counters over the rate window, links
that were up, GPUs seen), `cfg` the whole Config (thresholds live in its
`health` section). Rules do no I/O and keep no state. Active Xids come
from the Xid tracker through `XidCondition`s in `Inputs`.

Alert names and their fixed facts are in health/alerts.py; the Xid rule
picks GpuXidCritical or GpuXidWarning from the catalog's severity.
deploy/prometheus/gpuwatchd-rules.yaml holds the same conditions in
PromQL with the same label sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gpuwatchd.config import Config
from gpuwatchd.health.alerts import ALERTS, GPU_LABELS, AlertInfo, summary
from gpuwatchd.health.history import History, View
from gpuwatchd.health.incident import xid_incident
from gpuwatchd.model import Action, Finding, Gpu, Labels, Severity, SourceSnapshot, labels_of
from gpuwatchd.pci import UNKNOWN_BUS
from gpuwatchd.state import NodeSnapshot

__all__ = [
    "ALERTS",
    "AlertInfo",
    "GPU_LABELS",
    "Inputs",
    "Rule",
    "XidCondition",
    "collectors_due",
    "presence_due",
    "summary",
]

NVML_OK, NVML_UNRESPONSIVE, NVML_LOST = 0, 1, 2  # gpuwatchd_gpu_nvml_state
STALE_MIN = 30.0  # a poll loop may lag this much before it counts as stalled


@dataclass(frozen=True)
class XidCondition:
    """An Xid/SXid the tracker holds active, as the Xid rule needs it."""

    code: int
    pci_bus_id: str
    severity: Severity
    action: Action
    name: str
    remediation: str
    since: float
    kind: str = "xid"
    count: int = 1
    detail: str = ""
    workload: Labels = ()  # the report's workload attributes (pod, Slurm job, rank...)
    process: str = ""  # "pid N name" of the report, as the alert's description names it

    def text_labels(self) -> Labels:
        """What the alert's description names besides its labels (health/xid/alert.py)."""
        return tuple((k, v) for k, v in (("name", self.name), ("process", self.process)) if v)


@dataclass(frozen=True)
class Inputs:
    """Everything one evaluation reads."""

    view: View
    history: History
    cfg: Config
    now: float  # wall time: for display
    xids: Sequence[XidCondition] = field(default_factory=tuple)
    mono: float = 0.0  # monotonic time: ages and durations (0: unknown, wall is used)

    def age(self, snap: SourceSnapshot) -> float:
        """Seconds since `snap` was polled; a wall clock step does not change it."""
        if self.mono and snap.monotonic:
            return self.mono - snap.monotonic
        return self.now - snap.timestamp if snap.timestamp else 0.0

    def failing_for(self, source: str) -> float:
        """Seconds `source` has been failing (monotonic when known)."""
        return self.history.failing_for(source, self.now, self.mono)


Rule = Callable[[Inputs], list[Finding]]


def finding(
    alertname: str,
    subject: Labels,
    reason: str,
    rule: str,
    *,
    scope: str = "gpu",
    labels: Labels = (),
    severity: Severity | None = None,
    action: Action | None = None,
    remediation: str = "",
    since: float = 0.0,
) -> Finding:
    """A Finding with the alert's fixed facts filled in."""
    info = ALERTS[alertname]
    return Finding(
        rule=rule,
        alertname=alertname,
        scope=scope,
        subject=subject,
        severity=info.severity if severity is None else severity,
        reason=reason,
        action=info.action if action is None else action,
        remediation=remediation or info.remediation,
        labels=labels,
        since=since,
    )


def _gpus_with(inp: Inputs, name: str, **match: str) -> Iterable[tuple[Gpu, float]]:
    for s in inp.view.series(name, **match):
        gpu = inp.view.gpu_of(s)
        if gpu is not None:
            yield gpu, s.value


# --- the rules ---------------------------------------------------------------


def xid(inp: Inputs) -> list[Finding]:
    """Active Xids (catalog severity, held by the tracker) and SXids."""
    out = []
    for x in inp.xids:
        if x.severity < Severity.WARNING or x.kind not in ("xid", "sxid"):
            continue
        critical = x.severity >= Severity.CRITICAL
        labels: Labels
        if x.kind == "sxid":
            name = "NvswitchSxidCritical" if critical else "NvswitchSxidWarning"
            subject, scope, labels = (
                labels_of({"pci_bus_id": x.pci_bus_id}),
                "node",
                (("sxid", str(x.code)),),
            )
        elif not x.pci_bus_id:  # the line named no GPU (a fall-off cut short): the node's
            name = "GpuXidCritical" if critical else "GpuXidWarning"
            subject = labels_of({"pci_bus_id": UNKNOWN_BUS})
            scope, labels = "node", (("xid", str(x.code)), *x.text_labels(), *x.workload)
        else:
            name = "GpuXidCritical" if critical else "GpuXidWarning"
            gpu = inp.view.gpu_by_bus(x.pci_bus_id)
            subject = gpu.subject if gpu else labels_of({"pci_bus_id": x.pci_bus_id})
            incident = ("incident", xid_incident(x.pci_bus_id, x.code))
            scope, labels = "gpu", (("xid", str(x.code)), *x.text_labels(), incident, *x.workload)
        times = f" ({x.count} times)" if x.count > 1 else ""
        detail = f": {x.detail}" if x.detail else ""
        reason = f"{x.kind.capitalize()} {x.code} ({x.name}){times}{detail}"
        out.append(
            finding(
                name,
                subject,
                reason,
                "xid",
                scope=scope,
                labels=labels,
                severity=x.severity,
                action=x.action,
                remediation=x.remediation,
                since=x.since,
            )
        )
    return out


def ecc_uncorrectable(inp: Inputs) -> list[Finding]:
    """An uncorrectable ECC counter rose within health.ecc_hold_seconds."""
    out: dict[Gpu, Finding] = {}
    hold = inp.cfg.health.ecc_hold_seconds
    for s in inp.view.series("gpuwatchd_gpu_ecc_errors_total", error="uncorrected"):
        gpu = inp.view.gpu_of(s)
        rise = inp.history.rose_within(s.name, s.labels, inp.now, hold)
        if gpu is None or rise is None or gpu in out:
            continue
        t, before, after = rise
        reason = (
            f"{s.label('scope')} uncorrected ECC errors rose from {before:g} to "
            f"{after:g} {inp.now - t:.0f}s ago"
        )
        out[gpu] = finding("GpuEccUncorrectable", gpu.subject, reason, "ecc_uncorrectable")
    return list(out.values())


def row_remap(inp: Inputs) -> list[Finding]:
    """Row remapping failed, or a remap / page retirement waits for a reset."""
    out = []
    for gpu, v in _gpus_with(inp, "gpuwatchd_gpu_row_remap_failure"):
        if v >= 1:
            out.append(
                finding(
                    "GpuRowRemapFailure",
                    gpu.subject,
                    "row remapping failure reported by NVML",
                    "row_remap",
                )
            )
    pending: dict[Gpu, list[str]] = {}
    for name, what in (
        ("gpuwatchd_gpu_row_remap_pending", "row remap pending"),
        ("gpuwatchd_gpu_retired_pages_pending", "retired pages pending"),
    ):
        for gpu, v in _gpus_with(inp, name):
            if v >= 1:
                pending.setdefault(gpu, []).append(what)
    out.extend(
        finding("GpuRowRemapPending", gpu.subject, f"{' and '.join(w)}: reset needed", "row_remap")
        for gpu, w in pending.items()
    )
    return out


def nvlink(inp: Inputs) -> list[Finding]:
    """A link that was up is down; a replay, recovery or CRC error counter rose."""
    down: dict[Gpu, list[str]] = {}
    for s in inp.view.series("gpuwatchd_nvlink_up"):
        gpu = inp.view.gpu_of(s)
        if gpu and s.value < 1 and (gpu.key, s.label("link")) in inp.history.links_up:
            down.setdefault(gpu, []).append(s.label("link"))
    out = [
        finding(
            "GpuNvlinkDown",
            gpu.subject,
            f"NVLink {', '.join(sorted(links, key=_num_key))} down (was up)",
            "nvlink",
        )
        for gpu, links in down.items()
    ]
    # Only the counters nvidia-smi nvlink -e shows (replay, recovery, crc): DCGM's
    # health watch fails on any rise of them; corrected errors are not looked at.
    limit = inp.cfg.health.nvlink_error_rate
    window = inp.cfg.health.rate_window_seconds
    worst: dict[Gpu, tuple[float, str]] = {}
    for s in inp.view.series("gpuwatchd_nvlink_errors_total"):
        gpu = inp.view.gpu_of(s)
        rise = inp.history.increase(s.name, s.labels, inp.now)
        if gpu and rise > 0 and rise / window > limit and rise > worst.get(gpu, (0.0, ""))[0]:
            worst[gpu] = (rise, f"link {s.label('link')} {s.label('error')}")
    out.extend(
        finding(
            "GpuNvlinkErrors",
            gpu.subject,
            f"{what} errors rose by {rise:g} in {window:.0f}s (threshold {limit:g}/s)",
            "nvlink",
        )
        for gpu, (rise, what) in worst.items()
    )
    return out


def thermal(inp: Inputs) -> list[Finding]:
    """Near the slowdown temperature; hardware/thermal slowdown or power brake active."""
    out = []
    margin = inp.cfg.health.temperature_margin_celsius
    for gpu in inp.view.gpus.values():
        for sensor, threshold in (("gpu", "slowdown"), ("memory", "memory_max")):
            temp = inp.view.gpu_value("gpuwatchd_gpu_temperature_celsius", gpu, sensor=sensor)
            limit = inp.view.gpu_value(
                "gpuwatchd_gpu_temperature_threshold_celsius", gpu, threshold=threshold
            )
            if temp is not None and limit is not None and temp >= limit - margin:
                out.append(
                    finding(
                        "GpuTemperatureHigh",
                        gpu.subject,
                        f"{sensor} temperature {temp:g} C, {threshold} threshold "
                        f"{limit:g} C (margin {margin:g} C)",
                        "thermal",
                    )
                )
                break
    active: dict[Gpu, list[str]] = {}
    wanted = set(inp.cfg.health.slowdown_reasons)
    for s in inp.view.series("gpuwatchd_gpu_clock_event_active"):
        owner = inp.view.gpu_of(s)
        if owner and s.value >= 1 and s.label("reason") in wanted:
            active.setdefault(owner, []).append(s.label("reason"))
    out.extend(
        finding(
            "GpuThermalSlowdown",
            g.subject,
            f"clock events active: {', '.join(sorted(r))}",
            "thermal",
        )
        for g, r in active.items()
    )
    return out


def pcie(inp: Inputs) -> list[Finding]:
    """Link below max width (or generation while busy); replays rising."""
    out = []
    h = inp.cfg.health
    for gpu in inp.view.gpus.values():
        problems = []
        v = inp.view.gpu_value
        width = v("gpuwatchd_gpu_pcie_link_width", gpu, which="current")
        max_width = v("gpuwatchd_gpu_pcie_link_width", gpu, which="max")
        if width is not None and max_width is not None and 0 < width < max_width:
            problems.append(f"width x{width:g} of x{max_width:g}")
        gen = v("gpuwatchd_gpu_pcie_link_generation", gpu, which="current")
        max_gen = v("gpuwatchd_gpu_pcie_link_generation", gpu, which="max")
        util = v("gpuwatchd_gpu_utilization_ratio", gpu, engine="gpu")
        busy = util is not None and util >= h.pcie_gen_min_utilization
        if gen is not None and max_gen is not None and 0 < gen < max_gen and busy:
            problems.append(f"generation {gen:g} of {max_gen:g} while {util:.0%} busy")
        replays = inp.view.series(
            "gpuwatchd_gpu_pcie_replays_total", uuid=gpu.uuid, gpu=str(gpu.index)
        )
        for s in replays:
            rate = inp.history.rate(s.name, s.labels, inp.now)
            if rate > h.pcie_replay_rate:
                problems.append(f"replays at {rate:.3g}/s (threshold {h.pcie_replay_rate:g}/s)")
        if problems:
            out.append(finding("GpuPcieDegraded", gpu.subject, "; ".join(problems), "pcie"))
    return out


def recovery_action(inp: Inputs) -> list[Finding]:
    """The driver's own verdict (NVML GPU recovery action) is not `none`."""
    actions = {
        1: ("GPU reset", Action.RESET_GPU),
        2: ("node reboot", Action.REBOOT_NODE),
        3: ("drain peer-to-peer", Action.DRAIN_AND_INSPECT),
        4: ("drain and reset", Action.RESET_GPU),
    }
    out = []
    for gpu, v in _gpus_with(inp, "gpuwatchd_gpu_recovery_action"):
        if v >= 1:
            what, action = actions.get(int(v), (f"action {v:g}", Action.REBOOT_NODE))
            out.append(
                finding(
                    "GpuRecoveryActionRequired",
                    gpu.subject,
                    f"NVML recovery action: {what}",
                    "recovery_action",
                    action=action,
                )
            )
    return out


def gpu_presence(inp: Inputs) -> list[Finding]:
    """GPU lost / NVML unresponsive per GPU; fewer GPUs than expected; NVML down."""
    out = []
    view, hist, h = inp.view, inp.history, inp.cfg.health
    for gpu, v in _gpus_with(inp, "gpuwatchd_gpu_nvml_state"):
        if v == NVML_LOST:
            out.append(finding("GpuLost", gpu.subject, "NVML reports GPU_IS_LOST", "gpu_presence"))
        elif v == NVML_UNRESPONSIVE:
            out.append(
                finding(
                    "NvmlUnresponsive",
                    gpu.subject,
                    "an NVML call for this GPU did not return in time",
                    "gpu_presence",
                )
            )
    nvml = view.source("nvml")
    expected = h.expected_gpus or hist.max_gpus
    if nvml is None:
        return out
    if not nvml.ok:
        failing = inp.failing_for("nvml")
        if expected and failing >= h.collector_failure_seconds:
            out.append(
                finding(
                    "NvmlUnresponsive",
                    (),
                    f"NVML collector failing for {failing:.0f}s: {nvml.error}",
                    "gpu_presence",
                    scope="node",
                )
            )
        return out
    for key, gpu in hist.gpus_seen.items():
        if key not in view.gpus and gpu.uuid:
            out.append(
                finding("GpuLost", gpu.subject, "GPU no longer listed by NVML", "gpu_presence")
            )
    visible = [s.value for s in view.series("gpuwatchd_gpus_visible")]
    count = int(visible[0]) if visible else len(view.gpus)
    if expected and count < expected:
        basis = "health.expected_gpus" if h.expected_gpus else "GPUs seen at first start"
        out.append(
            finding(
                "GpuCountLow",
                (),
                f"{count} GPU(s) visible, {expected} expected ({basis})",
                "gpu_presence",
                scope="node",
            )
        )
    return out


def collectors(inp: Inputs) -> list[Finding]:
    """A collector failing for longer than health.collector_failure_seconds."""
    out = []
    h = inp.cfg.health
    gpus_expected = bool(h.expected_gpus or inp.history.max_gpus)
    for name, snap in inp.view.snapshot.sources.items():
        if name == "nvml" and gpus_expected:
            continue  # NvmlUnresponsive covers it
        failing = inp.failing_for(name)
        stale = inp.age(snap)
        if not snap.ok and failing >= h.collector_failure_seconds:
            why = f"failing for {failing:.0f}s: {snap.error or 'error'}"
        elif stale > max(h.collector_failure_seconds, 3 * _interval(inp.cfg, name), STALE_MIN):
            why = f"no poll finished for {stale:.0f}s"
        else:
            continue
        out.append(
            finding(
                "GpuwatchdCollectorFailed",
                labels_of({"collector": name}),
                f"collector {name} {why}",
                "collectors",
                scope="component",
            )
        )
    return out


def _interval(cfg: Config, source: str) -> float:
    section = getattr(cfg.sources, source, None)
    return float(getattr(section, "interval", 0.0) or 0.0)


def _num_key(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 30, text)


# --- when time alone can change a rule's answer (the engine skips quiet ticks before) ---


def presence_due(snapshot: NodeSnapshot, history: History, cfg: Config) -> float:
    """gpu_presence: NVML failing since `fail_since` crosses collector_failure_seconds."""
    nvml, since = snapshot.sources.get("nvml"), history.fail_since.get("nvml")
    if nvml is None or nvml.ok or since is None:
        return float("inf")
    return since + cfg.health.collector_failure_seconds


def collectors_due(snapshot: NodeSnapshot, history: History, cfg: Config) -> float:
    """collectors: a failing collector's time, or a poll's age, crosses its threshold."""
    h = cfg.health
    due = float("inf")
    for name, snap in snapshot.sources.items():
        since = history.fail_since.get(name)
        if not snap.ok and since is not None:
            due = min(due, since + h.collector_failure_seconds)
        if snap.timestamp:
            stale = max(h.collector_failure_seconds, 3 * _interval(cfg, name), STALE_MIN)
            due = min(due, snap.timestamp + stale)
    return due
