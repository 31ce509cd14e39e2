"""One view of a suspected hang across the job's ranks, from RAS and stacks together.

For each rank: where it is (the collective or call its main thread is in),
its collective counts from RAS; for the job: the first frame where the
ranks' main-thread stacks diverge, the missing and unresponsive ranks and
where they run, and the facts the signature catalog matches on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.hangs.signatures import Signature, match
from gpuwatchd.health.hangs.verdict import rank_ranges
from gpuwatchd.jobview import JobView, RasReport, StackCapture

__all__ = ["HangSummary", "RankSummary", "summarize", "where_stuck"]

# Calls worth naming as "where a rank is", innermost match wins.
_CALLS = re.compile(
    r"(all_reduce|allreduce|all_gather|allgather|reduce_scatter|reducescatter|broadcast|"
    r"all_to_all|alltoall|barrier|\bsend\b|\brecv\b|\breduce\b|"
    r"waitForWorkers|init_process_group|destroy_process_group|ncclCommDestroy|ncclCommAbort|"
    r"_try_get_data|synchronize|cudaStreamSynchronize|cudaDeviceSynchronize|cuCtxSynchronize|"
    r"\bwait\b)",
    re.IGNORECASE,
)
_COLLECTIVES = re.compile(
    r"(all_reduce|allreduce|all_gather|allgather|reduce_scatter|reducescatter|broadcast|"
    r"all_to_all|alltoall|barrier|\breduce\b)",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class RankSummary:
    """Where one rank is."""

    pid: int
    rank: int | None
    gpus: tuple[str, ...]
    state: str  # the detector's spin | idle | busy | unknown
    where: str = ""  # the call its main thread is in, "" when no stack
    collective: str = ""  # the collective it is in, "" when none
    collective_counts: Mapping[str, int] = field(default_factory=dict)
    stack_error: str = ""


@dataclass(frozen=True, slots=True)
class HangSummary:
    """The cross-rank view stored with the event and sent with the alert."""

    job: str
    ranks: tuple[RankSummary, ...]
    missing: tuple[str, ...]  # "rank 1 (left)", "rank 3 on 10.0.0.2 pid 77 (RAS)"
    unresponsive: tuple[str, ...]
    diverging_frame: str
    facts: tuple[str, ...]
    signatures: tuple[str, ...]  # matched, best first
    signature: Signature | None

    def where_line(self) -> str:
        """`rank 0: all_reduce; rank 1: missing` for alert annotations."""
        parts = [
            f"rank {r.rank if r.rank is not None else '?'} (pid {r.pid}): {r.where or r.state}"
            for r in self.ranks
        ]
        parts += [f"{m}: missing" for m in self.missing]
        return "; ".join(parts)


def _python_or_named(frames: Sequence[str]) -> str:
    for f in frames:
        if ".py:" in f:
            return f.split(" (")[0]
    return frames[0].split(" (")[0] if frames else ""


def where_stuck(capture: StackCapture | None) -> tuple[str, str]:
    """(the call the main thread is in, the collective if it is one) from a stack."""
    if capture is None or not capture.ok:
        return "", ""
    main = capture.main_thread()
    if main is None:
        return "", ""
    texts = [f.text() for f in main.frames]
    where = next((f.function for f in main.frames if _CALLS.search(f.function)), "")
    coll = next((f.function for f in main.frames if _COLLECTIVES.search(f.function)), "")
    return where or _python_or_named(texts), coll


def stacks_confirm(first: Mapping[int, StackCapture], second: Mapping[int, StackCapture]) -> bool:
    """Every rank's main thread in the same call in two dumps taken some seconds apart."""
    pids = [p for p in first if first[p].ok]
    if not pids:
        return False
    for pid in pids:
        where, _ = where_stuck(first[pid])
        if not where or where_stuck(second.get(pid))[0] != where:
            return False
    return True


def _diverging(stacks: Sequence[StackCapture]) -> str:
    mains = [m for m in (s.main_thread() for s in stacks if s.ok) if m is not None]
    if len(mains) < 2:
        return ""
    outer_first = [[f.text() for f in reversed(m.frames)] for m in mains]
    for i in range(max(len(s) for s in outer_first)):
        column = {s[i] if i < len(s) else "" for s in outer_first}
        if len(column) > 1:
            return " | ".join(sorted(c or "(end)" for c in column))
    return ""


def _ras_facts(report: RasReport | None, pids: set[int]) -> tuple[set[str], list[str], list[str]]:
    facts: set[str] = set()
    missing: list[str] = []
    unresponsive: list[str] = []
    if report is None:
        return facts, missing, unresponsive
    for comm in report.communicators:
        mine = [r for r in comm.ranks if not pids or r.pid in pids] or list(comm.ranks)
        if any(r.destroy_flag for r in mine):
            facts.add("ras:destroying")
        if any(r.abort_flag for r in mine):
            facts.add("ras:aborting")
        if any(r.async_error for r in mine):
            facts.add("ras:async_error")
        if any(r.finalize_called for r in mine):
            facts.add("ras:finalizing")
        totals = {sum(r.collective_counts.values()) for r in comm.ranks}
        per_kind = [tuple(sorted(r.collective_counts.items())) for r in comm.ranks]
        if len(comm.ranks) > 1 and (len(totals) > 1 or len(set(per_kind)) > 1):
            facts.add("ras:counts_diverge")
        for m in comm.missing_ranks:
            host = m.get("host", "")
            desc = f"rank {m.get('rank', '?')}" + (f" on {host}" if host else "")
            if m.get("pid"):
                desc += f" pid {m['pid']}"
            missing.append(desc + f" (RAS, communicator {comm.hash})")
        if comm.missing_ranks_count and not comm.missing_ranks:
            missing.append(f"{comm.missing_ranks_count} rank(s) of communicator {comm.hash} (RAS)")
    if missing:
        facts.add("ras:missing_ranks")
    if report.timeouts_count:
        unresponsive.append(f"{report.timeouts_count} RAS peer(s) timed out")
    for key in ("unresponsive_processes", "dead_processes"):  # newer NCCL, when present
        items = report.extra.get(key)
        if isinstance(items, list):
            unresponsive.extend(str(item) for item in items)
    return facts, missing, unresponsive


def summarize(
    job: JobView,
    verdict: JobVerdict,
    stacks: Mapping[int, StackCapture],
    report: RasReport | None,
    catalog: Sequence[Signature],
    extra_facts: Iterable[str] = (),
) -> HangSummary:
    """Combine the detector's verdict, the ranks' stacks, the RAS answer (and other facts)."""
    states = dict(verdict.rank_states)
    counts_by_pid: dict[int, Mapping[str, int]] = {}
    if report is not None:
        for comm in report.communicators:
            for rr in comm.ranks:
                if rr.pid is not None and rr.pid not in counts_by_pid:
                    counts_by_pid[rr.pid] = rr.collective_counts
    ranks = []
    for r in job.ranks:
        cap = stacks.get(r.pid)
        where, coll = where_stuck(cap)
        ranks.append(
            RankSummary(
                pid=r.pid,
                rank=r.rank,
                gpus=r.gpus,
                state=states.get(r.pid, "unknown"),
                where=where,
                collective=coll,
                collective_counts=counts_by_pid.get(r.pid, {}),
                stack_error=cap.error if cap is not None and not cap.ok else "",
            )
        )
    facts = {f"cond:{c}" for c in verdict.conditions}
    if verdict.elsewhere:
        facts.add("ranks:not_arrived")  # the rendezvous waits for ranks of other nodes
    elif "rank_missing" in verdict.conditions and not verdict.missing_ranks:
        facts.add("ranks:never_started")  # none seen and gone: the job is starting
    ras_facts, ras_missing, unresponsive = _ras_facts(report, {r.pid for r in job.ranks})
    facts |= ras_facts
    facts |= set(extra_facts)
    colls = [r.collective for r in ranks if r.where]
    if len(colls) >= 2:
        distinct = {c for c in colls if c}
        if len(distinct) > 1:
            facts.add("stacks:different_collectives")
        elif len(distinct) == 1 and colls.count(next(iter(distinct))) == len(colls) - 1:
            facts.add("stacks:one_rank_elsewhere")
    missing = [f"rank {m}" for m in verdict.missing_ranks]
    if verdict.elsewhere:
        word = "rank" if len(verdict.elsewhere) == 1 else "ranks"
        missing.append(f"{word} {rank_ranges(verdict.elsewhere)} (expected on other nodes)")
    elif verdict.missing_count > len(verdict.missing_ranks):
        missing.append(
            f"{verdict.missing_count - len(verdict.missing_ranks)} rank(s) never started"
        )
    missing += ras_missing
    frames = [f.text() for cap in stacks.values() if cap.ok for t in cap.threads for f in t.frames]
    matched = match(catalog, facts, frames) if verdict.suspected else []
    return HangSummary(
        job=job.job,
        ranks=tuple(ranks),
        missing=tuple(missing),
        unresponsive=tuple(unresponsive),
        diverging_frame=_diverging(list(stacks.values())),
        facts=tuple(sorted(facts)),
        signatures=tuple(s.name for s in matched),
        signature=matched[0] if matched else None,
    )
