"""Why a job hangs: a hang joined to what broke on the node, as one incident.

The monitor runs on the consumer thread, which sees every publish; its
`CauseMemory` keeps the node signals of the last `WINDOW_SECONDS`
(cause_signals.py: the kernel killing a rank, Xids, a GPU lost, ECC, NVLink,
InfiniBand, PCIe AER, /dev/shm, memory pressure, slowdowns). When a job hangs it
joins them to the job by affinity (the rank's pid; its GPU; the GPU's NVLink
peers; the NICs near it; the PCIe functions from the GPU up to its root port;
the rank's memory cgroup; the node for /dev/shm and the node's memory pressure)
and by time, relative to the verdict's `since` (when the first rank stalled or
died): from `LOOKBACK_SECONDS` before to `LATE_SECONDS` after (a counter polled
every 10-30 s reports its change after the fact). The `Incident` ranks the
causes (kind, then a rank that died before one that waits, then the nearest in
time): the first is the cause, the rest are alternatives; with none it says
which signals were looked at.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuwatchd.health.hangs.cause_signals import (
    CAUSE_KINDS,
    LOOKED_AT,
    NodeSignal,
    SignalReader,
)
from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.jobview import JobView, RankView
from gpuwatchd.model import Event, GpuInventory, SourceSnapshot

__all__ = ["CAUSE_KINDS", "Cause", "CauseMemory", "Incident"]

WINDOW_SECONDS = 900.0
LOOKBACK_SECONDS = 600.0  # a kill or a fault up to this long before the stall
LATE_SECONDS = 60.0  # reported up to this long after it (polled counters, kernel log lag)
MAX_ALTERNATIVES = 4
KILLS = ("oom_kill", "segfault", "trap", "hung_task")


@dataclass(frozen=True, slots=True)
class Cause:
    """One thing on this node that can explain the hang, and its evidence."""

    kind: str  # one of CAUSE_KINDS
    what: str  # "killed by the OOM killer (memory cgroup /kubepods/pod-x)"
    where: str  # "pid 4242", "GPU 1 (0000:06:00.0)", "mlx5_0 port 1 (near GPU 0,1)"
    at: float  # when (wall clock)
    offset_seconds: float  # at - the verdict's since: < 0 before the first rank stopped
    rank: int | None = None  # the rank it hit (None: the job's, not one rank's)
    pid: int | None = None
    affinity: str = ""  # how it joins: pid, gpu, nvlink_peer, nic, pcie_path, cgroup, node
    evidence: str = ""  # the kernel line or the counter's values
    incident: str = ""  # the alert label it shares with its own alert (Xids)

    @property
    def text(self) -> str:
        """'rank 3 (pid 4242) killed by the OOM killer (...) 2.1 s before the job stopped'."""
        who = f"rank {self.rank}" if self.rank is not None else ""
        if self.pid is not None:
            who = f"{who} (pid {self.pid})" if who else f"pid {self.pid}"
        on = "" if not self.where or self.where.startswith("pid ") else f" on {self.where}"
        if self.affinity == "nvlink_peer":
            on += ", an NVLink peer of its GPU"
        sep = " " if self.kind in KILLS else ": "
        head = f"{who}{sep}{self.what}{on}" if who else f"{self.what}{on}"
        off = self.offset_seconds
        when = f"{abs(off):.1f} s {'before' if off <= 0 else 'after'} the job stopped"
        return f"{head} {when}"


@dataclass(frozen=True, slots=True)
class Incident:
    """One hang's causes on this node: the first is the cause, then the alternatives."""

    causes: tuple[Cause, ...] = ()
    looked_at: tuple[str, ...] = ()  # the signals looked at (LOOKED_AT's texts)
    elsewhere: tuple[str, ...] = ()  # nodes where a rank died or lags (RAS): theirs to name

    @property
    def cause(self) -> Cause | None:
        return self.causes[0] if self.causes else None

    @property
    def label(self) -> str:
        """The `incident` label: the cause's own alert's, else ''."""
        return self.cause.incident if self.cause is not None else ""

    def headline(self) -> str:
        """One line: the cause, or why none is named."""
        if self.cause is not None:
            there = ", ".join(self.elsewhere)
            tail = f"; ranks lost on {there}: their daemon names what broke there" if there else ""
            return self.cause.text + tail
        if self.elsewhere:
            return (
                f"no cause seen on this node; the rank that stopped first runs on "
                f"{', '.join(self.elsewhere)}: its daemon names the cause"
            )
        return "no cause seen on this node (looked at: " + "; ".join(self.looked_at) + ")"

    def lines(self) -> list[str]:
        """The headline, then each alternative."""
        out = [self.headline()]
        out += [f"alternative: {c.text}" for c in self.causes[1:]]
        return out


class CauseMemory:
    """Recent node signals and the join of a hung job with them."""

    def __init__(self) -> None:
        self.reader = SignalReader()

    def note_gpus(self, gpus: GpuInventory) -> None:
        """The GPUs of NVML's last poll (index -> bus id, NVLink peers)."""
        self.reader.note_inventory(gpus)

    def note(self, source: SourceSnapshot | None, events: Iterable[Event], now: float) -> None:
        """One publish: its events, and its source's samples when they are new."""
        if source is not None:
            self.reader.note_source(source)
        self.reader.note_events(events)
        self.reader.forget(now - WINDOW_SECONDS)

    def incident(self, job: JobView, verdict: JobVerdict) -> Incident:
        """The causes of `verdict`'s hang on this node, ranked."""
        t0 = verdict.since
        dead = set(verdict.dead_pids)
        found: list[tuple[tuple[int, int, float], Cause]] = []
        taken: set[tuple[str, str, float]] = set()
        for sig in self.reader.signals:
            if not -LOOKBACK_SECONDS <= sig.time - t0 <= LATE_SECONDS:
                continue
            hit = self._match(sig, job.ranks, dead)
            if hit is None:
                continue
            rank, how = hit
            other = how == "gpu" and sig.own_process and sig.pid is not None
            key = (sig.kind, sig.where, sig.time)
            if key in taken:
                continue
            taken.add(key)
            cause = Cause(
                kind=sig.kind,
                what=f"{sig.what} of pid {sig.pid}, no rank of the job" if other else sig.what,
                where=sig.where,
                at=sig.time,
                offset_seconds=sig.time - t0,
                rank=rank.rank if rank is not None and not other else None,
                pid=rank.pid if rank is not None and not other else None if other else sig.pid,
                affinity=how,
                evidence=sig.evidence,
                incident=sig.incident,
            )
            first = rank is not None and rank.pid in dead
            # another process's application error on a shared GPU: listed, after every other
            kind_rank = len(CAUSE_KINDS) if other else CAUSE_KINDS.index(sig.kind)
            order = (kind_rank, 0 if first else 1, abs(sig.time - t0))
            found.append((order, cause))
        found.sort(key=lambda x: x[0])
        causes = tuple(c for _, c in found[: 1 + MAX_ALTERNATIVES])
        looked = tuple(LOOKED_AT[s] for s in LOOKED_AT if s in self.reader.sources)
        return Incident(causes, looked, verdict.nodes)

    def _match(
        self, sig: NodeSignal, ranks: Iterable[RankView], dead: set[int]
    ) -> tuple[RankView | None, str] | None:
        """The rank a signal is near (a dead one first) and how; None if none is."""
        ordered = sorted(ranks, key=lambda r: (r.pid not in dead, r.pid))
        if sig.node_wide:
            return (ordered[0] if len(ordered) == 1 else None), "node"
        for r in ordered:
            if sig.pid is not None and sig.pid == r.pid:
                return r, "pid"
            if r.pid in sig.pids:
                return r, "cgroup"
        if sig.kind in KILLS or sig.pids:
            return None  # another process's (or memory cgroup's): not this job's
        for r in ordered:
            if sig.gpus & set(r.gpus):
                if sig.kind == "nvlink" and sig.gpu not in r.gpus:
                    return r, "nvlink_peer"
                return r, {"infiniband": "nic", "pcie": "pcie_path"}.get(sig.kind, "gpu")
        return None
