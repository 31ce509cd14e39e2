"""The detector's conclusion about one job at one probe, and its words for it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.health.hangs.gpu import GpuActivity, HangThresholds
from gpuwatchd.health.hangs.memory import JobMemory
from gpuwatchd.jobview import JobView

__all__ = [
    "CONDITIONS",
    "CRITICAL",
    "JobVerdict",
    "Sighting",
    "build_verdict",
    "busy_words",
    "rank_ranges",
]

CONDITIONS = (
    "rank_dead",
    "rank_missing",
    "collective_stall",
    "kernel_stuck",
    "gpu_stall",
    "cpu_stall",
    "straggler",
)
CRITICAL = frozenset({"rank_dead", "rank_missing", "collective_stall", "kernel_stuck"})


@dataclass(frozen=True, slots=True)
class JobVerdict:
    """What the detector concludes about one job at one poll."""

    job: str
    conditions: tuple[str, ...]  # those held long enough, in CONDITIONS order
    since: float
    signals: str  # which signals decided, "+"-joined: liveness, ras, io, gpu, gpm, cpu, stacks
    missing_ranks: tuple[int, ...] = ()  # ranks gone (local, or named by RAS)
    missing_count: int = 0
    straggler_pids: tuple[int, ...] = ()  # ranks making progress while the others wait
    rank_states: tuple[tuple[int, str], ...] = ()  # (pid, progress|waiting|gone|...)
    reason: str = ""
    severity: str = ""  # critical | warning; "" = the signature's
    dead_pids: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()  # hosts (RAS) of ranks that lag or died
    elsewhere: tuple[int, ...] = ()  # ranks expected on other nodes that never arrived

    @property
    def suspected(self) -> bool:
        """True when any condition has held long enough."""
        return bool(self.conditions)


@dataclass(frozen=True, slots=True)
class Sighting:
    """What the stack evidence added (early.py): the ranks elsewhere, the stuck kernel."""

    elsewhere: tuple[int, ...] = ()  # the rendezvous waits for these ranks
    local: tuple[int, ...] = ()  # the ranks here, all in the rendezvous
    kernel: str = ""  # "GPU 0 at 100 % utilisation, SM activity 0.8 %"
    where: str = ""  # the call the ranks wait in


def rank_ranges(ranks: Iterable[int]) -> str:
    """`1, 3-7, 9`: a world of thousands stays one line."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == r - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        elif out and out[-1].isdigit() and int(out[-1]) == r - 1:
            out[-1] = f"{out[-1]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


def build_verdict(
    t: HangThresholds,
    job: JobView,
    mem: JobMemory,
    decided: tuple[str, ...],
    held: Mapping[str, float],
    signals: Mapping[str, str],
    states: list[tuple[int, str]],
    progressing: list[int],
    ras_dead: Mapping[int, tuple[str, float]],
    short: int,
    now: float,
    seen: Sighting,
) -> JobVerdict:
    """The verdict with its reason, severity and the ranks it names."""
    since = min((held[c] for c in decided), default=now)
    parts = []
    gone_ranks = tuple(sorted({r for p in mem.gone if (r := mem.seen.get(p)) is not None}))
    dead_ranks = tuple(sorted(set(gone_ranks) | set(ras_dead)))
    nodes = tuple(sorted({host for host, _ in ras_dead.values() if host}))
    if "rank_dead" in decided:
        names = ", ".join(str(r) for r in dead_ranks) or "?"
        pids = ", ".join(str(p) for p in sorted(mem.gone))
        parts.append(
            f"rank {names} died"
            + (f" (pid {pids})" if pids else "")
            + " and the others have made no progress since"
            + (" (RAS cannot reach it)" if ras_dead else "")
        )
    elsewhere = seen.elsewhere if "rank_missing" in decided and short <= 0 else ()
    if elsewhere:
        parts.append(
            f"{_ranks(seen.local)} of {job.world_size}"
            f" {'waits' if len(seen.local) == 1 else 'wait'} in the rendezvous"
            f" ({seen.where or 'init_process_group'}) for {now - held['rank_missing']:.0f} s;"
            f" {_ranks(elsewhere)} never arrived (expected on other nodes)"
        )
    elif "rank_missing" in decided:
        parts.append(
            f"{len(job.ranks)} local rank(s) running of {job.expected_local} expected;"
            " the others never started"
        )
    if "collective_stall" in decided:
        diverge = " and differ between ranks" if mem.ras.diverge() else ""
        parts.append(
            f"NCCL collective counts flat for {now - held['collective_stall']:.0f} s{diverge},"
            " no rank reads, writes or computes"
        )
    if "kernel_stuck" in decided:
        parts.append(
            f"a kernel never completes: {seen.kernel}, the host thread waiting in"
            f" {seen.where or 'a synchronize'} for {now - held['kernel_stuck']:.0f} s,"
            " no progress"
        )
    if "gpu_stall" in decided:
        parts.append("every GPU of the job busy doing nothing")
    if "cpu_stall" in decided:
        parts.append(  # its CPU time may move: a job blocked in a collective polls a little
            f"no rank used its GPU, did I/O or more than {t.max_cpu_ratio:.0%} of a core"
        )
    if "straggler" in decided:
        parts.append(
            f"pid {', '.join(map(str, progressing))} still works while the other ranks wait"
        )
    severity = ""
    if any(c in CRITICAL for c in decided):
        severity = "critical"
    elif "straggler" in decided and not set(decided) & {"gpu_stall", "cpu_stall"}:
        timeout = job.collective_timeout_seconds or t.collective_timeout_seconds
        severity = "critical" if now - held["straggler"] >= timeout else "warning"
        if severity == "critical":
            parts.append(f"for {now - held['straggler']:.0f} s, past the collective timeout")
    used = sorted({s for c in decided for s in signals.get(c, "").split("+") if s})
    if "rank_missing" in decided:
        count = len(elsewhere) or max(short, 0)
    else:
        count = len(dead_ranks) if "rank_dead" in decided else 0
    return JobVerdict(
        job=job.job,
        conditions=decided,
        since=since,
        signals="+".join(used),
        missing_ranks=dead_ranks if "rank_dead" in decided else (),
        missing_count=count,
        straggler_pids=tuple(progressing) if "straggler" in decided else (),
        rank_states=tuple(states),
        reason="; ".join(parts),
        severity=severity,
        dead_pids=tuple(sorted(mem.gone)) if "rank_dead" in decided else (),
        nodes=nodes,
        elsewhere=elsewhere,
    )


def busy_words(g: GpuActivity | None) -> str:
    """`GPU 0 at 100 % utilisation, SM activity 0.8 %` (power where there is no GPM)."""
    if g is None:
        return "GPU ?"
    text = f"GPU {g.gpu} at {100 * (g.utilization or 0.0):.0f} % utilisation"
    if g.sm_active is not None:
        return text + f", SM activity {100 * g.sm_active:.1f} %"
    if g.power_watts is not None:
        return text + f", {g.power_watts:.0f} W"
    return text
