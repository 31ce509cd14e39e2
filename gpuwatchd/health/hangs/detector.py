"""Per-job hang decisions from progress: what a working job must move, and what moved.

Signals, strongest first (STYLE 29: a signal the job cannot fake decides):

- liveness: a rank's process gone (or a zombie) while its peers stay alive;
- NCCL RAS: per-rank collective counts (they only rise when collectives are
  launched) and the ranks RAS cannot reach;
- I/O: /proc/PID/io bytes of the rank and of its children (a checkpoint, data
  loading), and its children's CPU time (data-loader workers, compilers);
- GPU, supporting only: SM activity (else power) against the GPU's own peak;
- CPU time of the rank itself: progress only where nothing else speaks (no
  NCCL), since a rank waiting in a collective burns a core in a synchronize.

Conditions (CONDITIONS): `rank_dead` (a rank gone, or RAS names it, while
the others make no progress), `rank_missing` (fewer ranks than expected at
start-up while the present ones wait), `collective_stall` (RAS counts flat and
no rank makes progress), `gpu_stall` / `cpu_stall` (the older signals, for
jobs without RAS), `straggler` (some ranks progress while others wait: a
warning, critical once it lasts to the job's collective timeout). Once decided,
`rank_dead` and `rank_missing` stay until the rank is back, the job ends or RAS
counts rise (memory.keep_decided); I/O the monitor caused itself is no progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuwatchd.health.hangs.early import StackEvidence
from gpuwatchd.health.hangs.gpu import (
    GpuActivity,
    GpuBaseline,
    HangThresholds,
    activity_from_samples,
    classify,
)
from gpuwatchd.health.hangs.memory import JobMemory, keep_decided, replace_ranks
from gpuwatchd.health.hangs.ras_view import JobRas, RasView, job_ras
from gpuwatchd.health.hangs.verdict import (
    CONDITIONS,
    JobVerdict,
    Sighting,
    build_verdict,
    busy_words,
)
from gpuwatchd.jobview import JobView, RankView

__all__ = [
    "CONDITIONS",
    "GpuActivity",
    "HangDetector",
    "HangThresholds",
    "JobVerdict",
    "RasView",
    "activity_from_samples",
    "classify",
]

FORGET_GONE_SECONDS = 300.0
# held from first seen ("blocked": every rank in a collective, nothing moving; "waiting":
# the same while RAS counts rose at the last answer; no verdict; "rendezvous", "spinning":
# the shapes early.py's stack evidence decides on)
_ONSET: tuple[str, ...] = ("rank_missing", "straggler", "gpu_stall", "cpu_stall", "blocked")
_ONSET += ("waiting", "rendezvous", "spinning")
_EARLY = {"rendezvous": "rendezvous", "spinning": "synchronize"}  # shape -> evidence kind


def _rate(now: float, new: float | None, old_t: float, old: float | None) -> float | None:
    if new is None or old is None or now <= old_t:
        return None
    return max(0.0, new - old) / (now - old_t)


class HangDetector:
    """Keeps each job's memory between polls (not thread-safe: one caller)."""

    def __init__(self, thresholds: HangThresholds) -> None:
        self.thresholds = thresholds
        self._jobs: dict[str, JobMemory] = {}
        self._baseline = GpuBaseline()
        self._gpus: dict[str, GpuActivity] = {}
        self._verdicts: list[JobVerdict] = []
        self._own_io: Mapping[int, tuple[float, float]] = {}
        self._due: float | None = None  # when the next early verdict may be decided

    def due(self) -> float | None:
        """When the next held condition may be decided; None: none held."""
        return self._due

    def observe(
        self,
        jobs: Sequence[JobView],
        gpus: Sequence[GpuActivity] | None,
        now: float,
        ras: Mapping[str, RasView] | None = None,
        own_io: Mapping[int, tuple[float, float]] | None = None,
        evidence: Mapping[str, StackEvidence] | None = None,
    ) -> list[JobVerdict]:
        """Feed one probe (gpus None: no new GPU reading); every job's verdict.

        `own_io`: pid -> (from, until), I/O the monitor itself caused in that span (a
        flight recorder dump it triggered); a probe interval that overlaps it reads no
        `io` progress for that rank. `evidence`: job -> what its ranks' stacks showed
        (early.py), asked for by `wants_stacks`.
        """
        self._own_io = own_io or {}
        self._due = None
        if gpus is not None:
            for g in gpus:
                self._baseline.update(g, now)
            self._gpus = {g.gpu: g for g in gpus}
        kept: dict[str, JobMemory] = {}
        verdicts = []
        for job in jobs:
            if not any(r.alive for r in job.ranks):
                continue  # the job ended
            mem = self._jobs.get(job.job) or JobMemory()
            if mem.last_seen and now - mem.last_seen > self.thresholds.max_gap_seconds:
                mem = JobMemory(
                    seen=mem.seen, ras=mem.ras, replaced=mem.replaced
                )  # a gap: start the clocks again
            view = (ras or {}).get(job.job)
            if view is not None:
                mem.ras = job_ras(mem.ras, view, job)
            mem.evidence = (evidence or {}).get(job.job, mem.evidence)
            verdicts.append(self._judge(job, mem, now, gpus is not None))
            mem.last_seen = now
            kept[job.job] = mem
        self._jobs = kept
        self._verdicts = verdicts
        return list(verdicts)

    def suspected(self) -> list[JobVerdict]:
        """The verdicts of the last poll that suspect a hang."""
        return [v for v in self._verdicts if v.suspected]

    def doubtful(self) -> list[str]:
        """Jobs worth asking RAS sooner: a rank gone or missing, counts flat, every rank waiting."""
        return [
            key
            for key, m in self._jobs.items()
            if m.gone
            or m.ras.missing
            or m.ras.flat_for() > 0
            or {"blocked", "waiting", "cpu_stall", "gpu_stall"} & set(m.onset)
        ]

    def wants_stacks(self) -> list[str]:
        """Jobs in a shape only stacks decide early (early.py), without evidence since."""
        out = []
        for key, m in self._jobs.items():
            for shape, kind in _EARLY.items():
                since = m.onset.get(shape)
                ev = m.evidence
                if since is not None and (ev is None or ev.kind != kind or ev.first_at < since):
                    out.append(key)
                    break
        return out

    def started(self) -> list[str]:
        """Jobs past NCCL start-up by evidence: every live rank's GPUs did real work once.

        Real work on every GPU means the job trained, so its first communicators are
        up: RAS may be asked before the age-based start-up grace ends.
        """
        return [
            key
            for key, m in self._jobs.items()
            if m.prev and all(pid in m.worked for pid in m.prev if pid not in m.gone)
        ]

    # --- one job ----------------------------------------------------------------------

    def _track(self, job: JobView, mem: JobMemory, now: float, fresh: bool) -> dict[int, set[str]]:
        """Update per-rank progress; the signals each rank moved at this poll."""
        t = self.thresholds
        moved: dict[int, set[str]] = {}
        replace_ranks(job, mem)
        for r in job.ranks:
            if r.pid in mem.replaced:
                continue
            if not r.alive:
                mem.gone.setdefault(r.pid, now)
                continue
            mem.seen[r.pid] = r.rank
            signals: set[str] = set()
            prev = mem.prev.get(r.pid)
            if prev is not None:
                pt, p = prev
                io = _rate(now, r.io_bytes, pt, p.io_bytes)
                own = self._own_io.get(r.pid)
                if own is not None and pt < own[1] and now > own[0]:
                    io = None  # the dump the monitor asked for, not the job's work
                child_io = _rate(now, r.child_io_bytes, pt, p.child_io_bytes)
                if max(io or 0.0, child_io or 0.0) >= t.io_progress_bytes_per_second:
                    signals.add("io")
                child_cpu = _rate(now, r.child_cpu_seconds, pt, p.child_cpu_seconds)
                if child_cpu is not None and child_cpu >= t.child_cpu_ratio:
                    signals.add("children")
                cpu = _rate(now, r.cpu_seconds, pt, p.cpu_seconds)
                if cpu is not None:
                    mem.cpu_ratio[r.pid] = cpu
                    mem.cpu_from[r.pid] = pt
            # GPU work is a state as of the last NVML reading, not an event with a window;
            # a rank first seen between readings (named after the poll) is read by the last.
            if fresh or r.pid not in mem.gpu_working:
                working = any(self._baseline.working(self._gpus.get(g), t) for g in r.gpus)
                mem.gpu_working[r.pid] = working
                if working:
                    mem.worked.add(r.pid)
            if mem.gpu_working.get(r.pid):
                signals.add("gpu")
            if signals - {"gpu"}:
                mem.progress_at[r.pid] = now
            moved[r.pid] = signals
            mem.prev[r.pid] = (now, r)
        present = {r.pid for r in job.ranks}
        for pid in set(mem.seen) - present:  # left the job's view without a goodbye
            mem.gone.setdefault(pid, now)
        mem.replaced &= present
        for pid, at in list(mem.gone.items()):
            if mem.dead_since is not None and mem.seen.get(pid) is not None:
                continue  # a decided dead rank is kept until it is replaced or the job ends
            if now - at > FORGET_GONE_SECONDS:  # a restarted job goes on with new ranks
                del mem.gone[pid]
                mem.seen.pop(pid, None)
                mem.prev.pop(pid, None)
        return moved

    def _kernel_sits(self, r: RankView) -> bool:
        """A kernel is resident on one of the rank's GPUs without working."""
        return any(self._baseline.resident(self._gpus.get(g), self.thresholds) for g in r.gpus)

    def _apart(self, alive: list[RankView], ras: JobRas) -> bool:
        """The ranks launched different collectives and every one behind waits in another.

        A rank behind whose GPU holds a waiting kernel is not catching up (counts that
        cross have none behind): the ranks sit in different collectives, none can end.
        A rank behind on another node could be working: not evident from here.
        """
        here = {r.pid: r for r in alive}
        behind = ras.behind_pids()
        return ras.diverge() and all(p in here and self._kernel_sits(here[p]) for p in behind)

    def _recent(self, mem: JobMemory, pid: int, now: float, window: float) -> bool:
        if mem.gpu_working.get(pid):
            return True
        at = mem.progress_at.get(pid)
        return at is not None and now - at < window

    def _judge(self, job: JobView, mem: JobMemory, now: float, fresh: bool) -> JobVerdict:
        t = self.thresholds
        moved = self._track(job, mem, now, fresh)
        alive = [r for r in job.ranks if r.alive]
        ras = mem.ras
        window = t.progress_window_seconds
        behind = ras.behind_pids()
        progressing: list[int] = []
        waiting: list[int] = []
        states: list[tuple[int, str]] = []

        def in_collective(r: RankView) -> bool:  # a kernel sits, or (no GPM) a core spins
            gs = [self._gpus.get(g) for g in r.gpus]
            if any(self._baseline.resident(g, t) for g in gs):
                return True
            no_gpm = not gs or any(g is None or g.sm_active is None for g in gs)
            return no_gpm and mem.cpu_ratio.get(r.pid, 0.0) > t.waiting_cpu_ratio

        for r in alive:
            cpu = mem.cpu_ratio.get(r.pid)
            busy_cpu = cpu is not None and cpu > t.waiting_cpu_ratio
            # A rank behind in the counts that burns a core catches up, unless a kernel
            # sits on its GPU: then it waits in another collective (unbalanced ranks).
            catching_up = r.pid in behind and busy_cpu and not self._kernel_sits(r)
            if self._recent(mem, r.pid, now, window) or catching_up:
                progressing.append(r.pid)
                states.append((r.pid, "progress"))
            else:
                waiting.append(r.pid)
                states.append((r.pid, "waiting"))
        states += [(pid, "gone") for pid in sorted(mem.gone)]
        cpu_flat = bool(alive) and all(
            mem.cpu_ratio.get(r.pid, 1.0) <= t.max_cpu_ratio for r in alive
        )
        gpu_rs = [self._gpus.get(g) for r in alive for g in r.gpus]
        resident = any(self._baseline.resident(g, t) for g in gpu_rs)
        spin = bool(gpu_rs) and all(classify(g, t)[0] == "spin" for g in gpu_rs)
        quiet_cpu = bool(alive) and all(
            mem.cpu_ratio.get(r.pid, 1.0) <= t.waiting_cpu_ratio for r in alive
        )

        def stuck(r: RankView) -> bool:  # a kernel sits on its GPU, or it uses no CPU
            kernel = any(self._baseline.resident(self._gpus.get(g), t) for g in r.gpus)
            return kernel or mem.cpu_ratio.get(r.pid, 1.0) <= t.waiting_cpu_ratio

        # Every rank waits (rather than computes on the CPU, which an idle GPU and a busy
        # core look like); without GPM a job known to NCCL is given the benefit.
        gpm = bool(gpu_rs) and all(g is not None and g.sm_active is not None for g in gpu_rs)
        blocked = bool(alive) and all(stuck(r) for r in alive)
        stuck_others = blocked or (ras.nccl and not gpm)
        # Flat counts are a hang when every rank sits in a collective, or RAS flags the
        # communicator (destroyed, aborted, failed). Ranks idle on both CPU and GPU with
        # clean communicators are a server waiting for work: cpu_stall's business.
        collective = bool(alive) and (all(in_collective(r) for r in alive) or ras.flagged())
        cpu_phase = bool(alive) and all(
            mem.cpu_ratio.get(r.pid, 0.0) > t.waiting_cpu_ratio for r in alive
        )
        worked = all(r.pid in mem.worked for r in alive)
        young = not worked and any(
            r.age_seconds is not None and r.age_seconds < t.startup_grace_seconds for r in alive
        )
        distributed = (job.world_size or 1) > 1 or len(set(mem.seen) | set(mem.gone)) > 1

        held: dict[str, float] = {}  # condition -> since
        signals: dict[str, str] = {}
        gone = set(mem.gone)
        # rank_dead: a rank left and no survivor has moved since; RAS naming it decides too
        if gone and alive:
            death = max(mem.gone.values())
            last_move = max([death, *(mem.progress_at.get(r.pid, death) for r in alive)])
            if any(mem.gpu_working.get(r.pid) for r in alive):
                last_move = now  # a survivor's GPU still works
            # A job known to NCCL waits for one RAS answer after the death (asked at
            # once): it names the rank missing, or says the job tore NCCL down.
            asked = not ras.nccl or ras.at > death or now - death >= t.ras_wait_seconds
            if stuck_others and asked and not ras.torn_down_after(death):
                held["rank_dead"] = last_move
                signals["rank_dead"] = "+".join(
                    ["liveness", "io"]
                    + ["ras"] * ras.nccl
                    + ["gpu"] * resident
                    + ["cpu"] * quiet_cpu
                )
        ras_dead = ras.dead_ranks(gone)
        if ras_dead and not progressing and stuck_others and not ras.rising():
            first = min(s for _, s in ras_dead.values())
            held["rank_dead"] = min(held.get("rank_dead", first), first)
            # RAS confirms what liveness and the survivors' GPUs may show already: keep both
            named = {"ras", *(["liveness"] if gone else [])}
            shown = set(signals.get("rank_dead", "").split("+")) - {""}
            signals["rank_dead"] = "+".join(sorted(named | shown))
        # rank_missing: fewer ranks than expected, none of them doing anything
        known = len(set(mem.seen) | gone)
        short = (job.expected_local or 0) - max(known, len(job.ranks))
        if short > 0 and alive and not progressing and (quiet_cpu or resident):
            # a quiet CPU ratio covers the span since the probe before: quiet from there
            began = max(mem.cpu_from.get(r.pid, now) for r in alive) if quiet_cpu else now
            held["rank_missing"] = mem.onset.get("rank_missing", began)
            signals["rank_missing"] = "liveness+" + ("cpu" if quiet_cpu else "gpu")
        keep_decided(mem, held, signals, bool(gone or ras_dead), bool(ras_dead), short > 0)
        flat_for = ras.flat_for() if not gone else 0.0
        evident = False  # counts flat and RAS shows why (_apart, or a torn communicator)
        # Every rank sits in a collective and nothing moves: when RAS then reads the counts
        # flat, the stall dates from here, not from the first answer (asked late at start).
        if alive and not gone and not progressing and collective:
            # counts that rose at the last answer: ask RAS again soon (doubtful), not blocked
            key = "waiting" if ras.rising() else "blocked"
            held[key] = mem.onset.get(key, now)
        if not young and not gone:
            flat = flat_for > 0 and ras.counts_since is not None
            if flat and not progressing and (collective or cpu_phase):
                assert ras.counts_since is not None
                since, confirmed = ras.counts_since, True
                if collective and "blocked" in held:
                    # Only an answer taken while every rank already waited proves that no
                    # collective completed since (a rank back from evaluation has not).
                    assert ras.counts_at is not None
                    confirmed = ras.counts_at >= held["blocked"]
                    since = min(since, held["blocked"])
                    flat_for = max(flat_for, now - since)
                if confirmed:
                    held["collective_stall"] = since
                    # RAS shows why none can complete: a shorter wait, from when every rank
                    # began to wait (not from counts flat during a pause)
                    evident = "blocked" in held and (ras.flagged() or self._apart(alive, ras))
                signals["collective_stall"] = "+".join(
                    ["ras", "io"] + ["gpu"] * resident + ["cpu"] * quiet_cpu
                )
            elif progressing and waiting and (flat or not ras.nccl):
                held["straggler"] = mem.onset.get("straggler", now)
                signals["straggler"] = "+".join(
                    sorted({s for p in progressing for s in moved.get(p, ())} or {"ras"})
                )
        # Without RAS (or before its grace): the GPUs and the CPU, unless counts rose lately
        # (a job stepping every few seconds, a slow data loader, shows flat answer pairs).
        counting = ras.rising() or (
            ras.rose_at is not None and now - ras.rose_at < t.collective_stall_seconds
        )
        # A distributed job's weak stalls wait for RAS to have its say: asked once, and
        # when the job speaks NCCL, twice (rising or flat). A slow loader idles CPU and GPU.
        unheard = t.await_ras and distributed and (ras.at == 0.0 or (ras.nccl and ras.answers < 2))
        if not gone and not progressing and not counting:
            fallen = bool(gpu_rs) and all(self._baseline.fallen(g, t) for g in gpu_rs)
            if spin or (fallen and distributed):  # a lone server idles below its peak
                held["gpu_stall"] = mem.onset.get("gpu_stall", now)
                signals["gpu_stall"] = "gpu+io" if fallen else classify(gpu_rs[0], t)[1]
            single = distributed or t.single_process_cpu_stall
            if cpu_flat and single and not resident:
                held["cpu_stall"] = mem.onset.get("cpu_stall", now)
                signals["cpu_stall"] = "cpu+io"
        seen = self._early(job, mem, alive, progressing, short, now, held, signals)
        mem.onset = {c: s for c, s in held.items() if c in _ONSET}
        timeout = job.collective_timeout_seconds or t.collective_timeout_seconds
        need = {
            "rank_dead": t.dead_peer_after_seconds,
            "rank_missing": t.remote_rank_missing_after_seconds
            if seen.elsewhere
            else t.rank_missing_after_seconds,
            "kernel_stuck": t.kernel_stuck_after_seconds,
            "gpu_stall": t.decide_after_seconds,
            "cpu_stall": t.decide_after_seconds,
            "straggler": t.straggler_after_seconds,
        }
        # ranks busy on the CPU with idle GPUs may compute: wait for the timeout
        stall_after = t.collective_stall_seconds if collective else timeout
        deadlock = evident and now - held["blocked"] >= t.collective_deadlock_seconds
        # A held condition falls due at a known time: the monitor probes then, not at
        # the next probe of its cadence (up to probe_interval_seconds later).
        dues = [held[c] + need[c] for c in need.keys() & held.keys()]
        dues += [held["blocked"] + t.collective_deadlock_seconds] if evident else []
        for at in (d for d in dues if d > now):
            self._due = min(self._due or float("inf"), at)
        decided = tuple(
            c
            for c in CONDITIONS
            if c in held
            and (
                flat_for >= stall_after or deadlock
                if c == "collective_stall"
                else (c == "rank_dead" and bool(ras_dead)) or now - held[c] >= need[c]
            )
            and not (unheard and c in ("gpu_stall", "cpu_stall"))
        )
        if "rank_dead" in decided and mem.dead_since is None:
            mem.dead_since, mem.dead_signals = held["rank_dead"], signals["rank_dead"]
        if "rank_missing" in decided and mem.missing_since is None and short > 0:
            mem.missing_since = held["rank_missing"]
        return build_verdict(
            t, job, mem, decided, held, signals, states, progressing, ras_dead, short, now, seen
        )

    def _early(
        self,
        job: JobView,
        mem: JobMemory,
        alive: list[RankView],
        progressing: list[int],
        short: int,
        now: float,
        held: dict[str, float],
        signals: dict[str, str],
    ) -> Sighting:
        """The two shapes only stacks decide early (early.py), held from when they began.

        - rendezvous: the local world complete, ranks of WORLD_SIZE missing here, every
          rank idle on CPU and GPU and never at work yet; the stacks show every rank in
          the rendezvous: `rank_missing`, the missing ranks expected on other nodes;
        - spinning: one process (not distributed) whose GPUs are busy with the SMs idle,
          no progress; the stacks show it waiting in a synchronize: `kernel_stuck`.
        """
        t = self.thresholds
        ev = mem.evidence
        if not alive or progressing or mem.gone:
            return Sighting()

        def shown(shape: str) -> bool:
            return ev is not None and ev.kind == _EARLY[shape] and ev.first_at >= held[shape]

        here = {r.rank for r in alive}
        world = job.world_size or 0
        gpus = [self._gpus.get(g) for r in alive for g in r.gpus]
        quiet = all(mem.cpu_ratio.get(r.pid, 1.0) <= t.waiting_cpu_ratio for r in alive)
        fresh = not any(r.pid in mem.worked for r in alive)
        sitting = any(self._baseline.resident(g, t) for g in gpus)
        if short <= 0 and None not in here and world > len(here) and quiet and fresh:
            if not sitting:
                # quiet since the probe before, where the span the CPU ratio reads began
                began = max(mem.cpu_from.get(r.pid, now) for r in alive)
                held["rendezvous"] = mem.onset.get("rendezvous", began)
                if shown("rendezvous"):
                    assert ev is not None
                    held["rank_missing"] = held["rendezvous"]
                    signals["rank_missing"] = "stacks+cpu"
                    held.pop("cpu_stall", None)
                    local = tuple(sorted(r for r in here if r is not None))
                    missing = tuple(r for r in range(world) if r not in here)
                    return Sighting(missing, local, where=ev.where)
        distributed = world > 1 or len(mem.seen) > 1
        spin = bool(gpus) and all(classify(g, t)[0] == "spin" for g in gpus)
        if spin and not distributed:
            held["spinning"] = mem.onset.get("spinning", now)
            if shown("spinning"):
                assert ev is not None
                held["kernel_stuck"] = held["spinning"]
                signals["kernel_stuck"] = classify(gpus[0], t)[1] + "+stacks"
                held.pop("gpu_stall", None)
                return Sighting(kernel="; ".join(map(busy_words, gpus)), where=ev.where)
        return Sighting()
