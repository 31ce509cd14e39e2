"""Rules for the node around the GPUs: /dev/shm, InfiniBand ports (and AER, in aer_rules).

Each takes the samples of one source (and, where a rule needs a trend,
those of the previous poll) and returns Findings. They read only what
the shm and infiniband sources export, so they work the same on a live
snapshot and on recorded samples.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpuwatchd.health.aer_rules import AerRules, AerThresholds
from gpuwatchd.model import Action, Finding, Labels, Sample, Severity
from gpuwatchd.ports import ERROR_COUNTERS, PHYS_LINK_UP, STATE_ACTIVE

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.state import NodeSnapshot

__all__ = ["NodeRules", "evaluate", "infiniband_findings", "shm_findings"]

IB = "gpuwatchd_infiniband_"
RATE_TOLERANCE = 0.99  # a port is degraded below 99 % of its expected rate
MIB = 1024 * 1024

SHM_FULL_FIX = (
    "Find what fills /dev/shm (ls -lS /dev/shm; stale NCCL or torch_* segments, "
    "leftover files of dead jobs) and delete what no process uses. In containers give "
    "/dev/shm more room (docker --shm-size, or a memory-backed emptyDir in Kubernetes)."
)
SHM_STALE_FIX = (
    "No process maps or opens these segments; a job died while NCCL was setting up. "
    "Delete them (rm /dev/shm/nccl-*, after checking no job is starting) or set "
    "sources.shm.cleanup_stale: true to let gpuwatchd remove them. /status lists them."
)
PORT_DOWN_FIX = (
    "Check the cable and the switch port (ibstat, ibstatus, the switch's logs); "
    "reseat or replace the cable or transceiver. Jobs using this port fail or fall back "
    "to slower paths; drain the node if it does not come back."
)
RATE_FIX = (
    "The link trained at a lower speed or width than expected: check for a bad cable or "
    "transceiver (mlxlink -d <device> shows the lanes and errors) and the switch port."
)
ERRORS_FIX = (
    "Link errors rising point to a marginal cable, transceiver or switch port: watch "
    "symbol and recovery errors with perfquery/mlxlink, reseat or replace the cable, "
    "and drain the node if they keep rising."
)


def _group(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    by: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by[s.name].append(s)
    return by


def _one(by: Mapping[str, list[Sample]], name: str) -> float | None:
    got = by.get(name)
    return got[0].value if got else None


# --- /dev/shm -------------------------------------------------------------------------


def shm_findings(samples: Iterable[Sample], full_warn_ratio: float = 0.9) -> list[Finding]:
    """/dev/shm nearly full (bytes or inodes) and stale NCCL segments."""
    by = _group(samples)
    out: list[Finding] = []
    size = _one(by, "gpuwatchd_shm_size_bytes")
    avail = _one(by, "gpuwatchd_shm_available_bytes")
    files = _one(by, "gpuwatchd_shm_files")
    ffree = _one(by, "gpuwatchd_shm_files_free")
    problems = []
    worst = Severity.WARNING
    if size and avail is not None and 1 - avail / size >= full_warn_ratio:
        problems.append(f"{100 * (1 - avail / size):.0f}% of its {size / MIB:.0f} MiB used")
        if avail <= 0:
            worst = Severity.CRITICAL
    if files and ffree is not None and 1 - ffree / files >= full_warn_ratio:
        problems.append(f"{100 * (1 - ffree / files):.0f}% of its inodes used")
        if ffree <= 0:
            worst = Severity.CRITICAL
    if problems:
        out.append(
            Finding(
                rule="shm_nearly_full",
                alertname="ShmNearlyFull",
                scope="node",
                subject=(("path", "/dev/shm"),),
                severity=worst,
                reason="/dev/shm has "
                + " and ".join(problems)
                + "; NCCL's intra-node transport fails with a system error when it cannot "
                "create its segments.",
                action=Action.NONE,
                remediation=SHM_FULL_FIX,
            )
        )
    stale = {s.label("state"): s.value for s in by.get("gpuwatchd_shm_segments", [])}
    stale_bytes = {s.label("state"): s.value for s in by.get("gpuwatchd_shm_segment_bytes", [])}
    count = stale.get("stale", 0.0)
    if count > 0:
        out.append(
            Finding(
                rule="shm_stale_segments",
                alertname="ShmStaleSegments",
                scope="node",
                subject=(("path", "/dev/shm"),),
                severity=Severity.WARNING,
                reason=f"{count:.0f} stale NCCL segment(s) in /dev/shm hold "
                f"{stale_bytes.get('stale', 0.0) / MIB:.1f} MiB and no live process uses them.",
                action=Action.NONE,
                remediation=SHM_STALE_FIX,
            )
        )
    return out


# --- InfiniBand -----------------------------------------------------------------------

Port = tuple[str, str]


def _ports(by: Mapping[str, list[Sample]], name: str) -> dict[Port, float]:
    return {(s.label("device"), s.label("port")): s.value for s in by.get(name, [])}


def _affinity(by: Mapping[str, list[Sample]]) -> dict[str, tuple[str, list[str]]]:
    """device -> (closest affinity, GPUs with it)."""
    ranked = ("pcie_switch", "host_bridge", "numa_node")
    best: dict[str, tuple[str, list[str]]] = {}
    for s in by.get(IB + "gpu_affinity_info", []):
        dev, kind, gpu = s.label("device"), s.label("affinity"), s.label("gpu")
        have = best.get(dev)
        if kind not in ranked:
            continue
        if have is None or ranked.index(kind) < ranked.index(have[0]):
            best[dev] = (kind, [gpu])
        elif have[0] == kind:
            have[1].append(gpu)
    return best


def _subject(port: Port) -> Labels:
    return (("device", port[0]), ("port", port[1]))


def _labels(port: Port, aff: Mapping[str, tuple[str, list[str]]]) -> tuple[Labels, str]:
    near = aff.get(port[0])
    if not near:
        return (), ""
    gpus = ",".join(sorted(near[1], key=lambda g: (len(g), g)))
    where = {"pcie_switch": "the same PCIe switch", "host_bridge": "the same root complex"}
    text = f" GPUs {gpus} ({where.get(near[0], 'the same NUMA node')}) rely on this port."
    return (("gpus", gpus),), text


def infiniband_findings(
    samples: Iterable[Sample], previous: Iterable[Sample] | None = None
) -> list[Finding]:
    """Port down, physical link not up, rate below expected, error counters rising."""
    by = _group(samples)
    aff = _affinity(by)
    state = _ports(by, IB + "state_id")
    phys = _ports(by, IB + "physical_state_id")
    rate = _ports(by, IB + "rate_bytes_per_second")
    expected_rate = _ports(by, IB + "expected_rate_bytes_per_second")
    expected_up = _ports(by, IB + "port_expected_up")
    names = {
        (s.label("device"), s.label("port")): (s.label("state"), s.label("physical_state"))
        for s in by.get(IB + "port_info", [])
    }
    out: list[Finding] = []
    for port in sorted(set(state) | set(phys)):
        labels, near = _labels(port, aff)
        st_name, ph_name = names.get(port, ("", ""))
        must = expected_up.get(port, 0) > 0
        if must and port in state and state[port] != STATE_ACTIVE:
            out.append(
                _ib(
                    "ib_port_down",
                    "InfinibandPortDown",
                    port,
                    Severity.CRITICAL,
                    f"{port[0]} port {port[1]} is {st_name or int(state[port])}, not ACTIVE, "
                    f"though it was ACTIVE before (or is configured as expected up).{near}",
                    Action.DRAIN_AND_INSPECT,
                    PORT_DOWN_FIX,
                    labels,
                )
            )
        if must and port in phys and phys[port] != PHYS_LINK_UP:
            out.append(
                _ib(
                    "ib_phys_state",
                    "InfinibandPhysicalStateNotLinkUp",
                    port,
                    Severity.WARNING,
                    f"{port[0]} port {port[1]} physical state is "
                    f"{ph_name or int(phys[port])}, not LinkUp.{near}",
                    Action.DRAIN_AND_INSPECT,
                    PORT_DOWN_FIX,
                    labels,
                )
            )
        want, have = expected_rate.get(port), rate.get(port)
        if (
            state.get(port) == STATE_ACTIVE
            and want
            and have is not None
            and have < want * RATE_TOLERANCE
        ):
            out.append(
                _ib(
                    "ib_rate_degraded",
                    "InfinibandRateDegraded",
                    port,
                    Severity.WARNING,
                    f"{port[0]} port {port[1]} runs at {have * 8 / 1e9:g} Gb/s, expected "
                    f"{want * 8 / 1e9:g} Gb/s.{near}",
                    Action.DRAIN_AND_INSPECT,
                    RATE_FIX,
                    labels,
                )
            )
    if previous is not None:
        out.extend(_rising(by, _group(previous), aff))
    return out


def _rising(
    by: Mapping[str, list[Sample]],
    prev: Mapping[str, list[Sample]],
    aff: Mapping[str, tuple[str, list[str]]],
) -> list[Finding]:
    grew: dict[Port, list[str]] = defaultdict(list)
    for name in sorted(ERROR_COUNTERS):
        before = _ports(prev, name)
        for port, value in _ports(by, name).items():
            old = before.get(port)
            if old is None:
                continue
            increase = value if value < old else value - old  # a decrease is a reset
            if increase > 0:
                short = name.removeprefix(IB).removesuffix("_total")
                grew[port].append(f"{short} +{increase:.0f}")
    out = []
    for port, what in sorted(grew.items()):
        labels, near = _labels(port, aff)
        out.append(
            _ib(
                "ib_errors_rising",
                "InfinibandErrorsRising",
                port,
                Severity.WARNING,
                f"{port[0]} port {port[1]} error counters rose since the last poll: "
                f"{', '.join(what)}.{near}",
                Action.NONE,
                ERRORS_FIX,
                labels,
            )
        )
    return out


def _ib(
    rule: str,
    alert: str,
    port: Port,
    severity: Severity,
    reason: str,
    action: Action,
    fix: str,
    labels: Labels,
) -> Finding:
    return Finding(
        rule=rule,
        alertname=alert,
        scope="port",
        subject=_subject(port),
        severity=severity,
        reason=reason,
        action=action,
        remediation=fix,
        labels=labels,
    )


# --- both, over snapshots --------------------------------------------------------------


def evaluate(
    snapshot: NodeSnapshot, previous: NodeSnapshot | None = None, cfg: Config | None = None
) -> list[Finding]:
    """All node rules over the shm and infiniband sources of a snapshot."""
    ratio = cfg.sources.shm.full_warn_ratio if cfg is not None else 0.9
    out: list[Finding] = []
    shm = snapshot.sources.get("shm")
    if shm is not None and shm.ok:
        out.extend(shm_findings(shm.samples, ratio))
    ib = snapshot.sources.get("infiniband")
    if ib is not None and ib.ok:
        before = previous.sources.get("infiniband") if previous is not None else None
        prev_samples: Sequence[Sample] | None = None
        if before is not None and before.ok and before.timestamp != ib.timestamp:
            prev_samples = before.samples
        out.extend(infiniband_findings(ib.samples, prev_samples))
    return out


class NodeRules:
    """Remembers the previous InfiniBand poll so `evaluate` can be called at any time.

    The health engine evaluates after every publish of any source; the
    "errors rising" rule must compare two distinct InfiniBand polls, and
    its verdict should hold until the next one. This keeps both.
    """

    def __init__(self, cfg: Config | None = None) -> None:
        self._cfg = cfg
        self._ib_stamp: float | None = None
        self._ib_prev: tuple[Sample, ...] | None = None
        self._ib_findings: list[Finding] = []
        self._aer = AerRules(AerThresholds.from_config(cfg))

    def evaluate(self, snapshot: NodeSnapshot) -> list[Finding]:
        """Findings of the shm, PCIe AER and infiniband rules for this snapshot."""
        ratio = self._cfg.sources.shm.full_warn_ratio if self._cfg is not None else 0.9
        out: list[Finding] = []
        shm = snapshot.sources.get("shm")
        if shm is not None and shm.ok:
            out.extend(shm_findings(shm.samples, ratio))
        out.extend(self._aer.evaluate(snapshot))
        ib = snapshot.sources.get("infiniband")
        if ib is None or not ib.ok:
            return out
        if ib.timestamp != self._ib_stamp:
            self._ib_findings = infiniband_findings(ib.samples, self._ib_prev)
            self._ib_prev, self._ib_stamp = ib.samples, ib.timestamp
        return out + list(self._ib_findings)
