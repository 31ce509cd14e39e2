"""The hang detector and its cause join as a user judges them: an open fault-injection benchmark.

Faults: every real hang recording of tests/fixtures/hangs (kind "hang" in its
expect.json; not those synthesized from others) replayed through the hang monitor
on a FakeClock with the `hangs:` keys its expect.json names, at its NVML poll
phases, each combined with one injected node event per cause class
(benchmarks/cause_faults.py: real kernel lines of tests/fixtures/kmsg parsed by
the kernel log source's parsers; the real InfiniBand and AER sources polling a
copy of tests/fixtures/sys whose port goes DOWN or whose switch port counts a
fatal error; the NVML source's series for a link down, a row-remap failure, a
thermal slowdown; /dev/shm's size and free bytes) at offsets before and after
the first stalled rank, with the noise of a healthy node on top.

No fault: the controls (healthy DDP/FSDP, checkpoints, eval pauses, slow data
loaders, compile start-ups, a normal end) and the healthy NVML captures, laid
out as a simulated schedule of node-days (job churn: start-ups and ends; a
checkpoint every 30 min, an eval pause every 2 h, a slow loader every 6 h) with
the same noise. Each distinct episode (recording x NVML phase) is replayed
with several noise draws; the pages of the node-days are the episodes' pages
times how often the schedule holds them (the replay of an episode does not
depend on the noise for its pages: checked on every run, the figure says so).

Figures: detection latency (first JobHangSuspected after the first stalled
rank) and naming latency (the incident's first cause is the injected one) p50
and p90 per class; the share of faults whose cause is named right; critical
pages per node-day without a fault; the hang path's thread CPU time per
simulated hour (HangMonitor.on_publish and tick; the harness's /proc writes,
RAS server and the sources' own polls are not in it).

    .venv/bin/python benchmarks/bench_hang_causes.py [--quick] [--node-days 100] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cause_faults import (  # noqa: E402
    CLASSES,
    INTERVALS,
    PID_CLASSES,
    XID_LINES,
    NodeFeed,
    hgx_polls,
)
from benchmarks.report import publish  # noqa: E402
from gpuwatchd.health.hangs.causes import CauseMemory  # noqa: E402
from gpuwatchd.model import Severity  # noqa: E402
from gpuwatchd.state import NodeSnapshot  # noqa: E402
from tests.hangs.real_trace import Trace, nvml_snapshot  # noqa: E402
from tests.hangs.replay import FIXTURES  # noqa: E402
from tests.hangs.scenario_replay import NVML_INTERVAL, Expect, Replay, replaying  # noqa: E402

OFFSETS = (-30.0, -5.0, 2.0, 8.0)  # seconds from the first stalled rank
DEAD = frozenset({"rank_dead"})
EMPTY = NodeSnapshot()
# A node-day's episodes: (control recording prefix, how many a day)
DAY = {
    "compile-start": 4.0,  # job churn: a job starts (NCCL start-up, compile) ...
    "ends-normally": 4.0,  # ... and ends, four a day
    "healthy-ddp": 12.0,  # steady training between the others, one recording per 2 h
    "healthy-fsdp": 12.0,
    "checkpoint": 48.0,  # every 30 min
    "eval-pause": 12.0,  # every 2 h
    "slow-loader": 4.0,  # every 6 h
}


@dataclass
class Outcome:
    """One replay: when it was flagged and named, pages, CPU and simulated seconds."""

    detected: float | None = None  # first finding, seconds after the first stalled rank
    named: float | None = None  # first tick whose incident names the injected cause
    cause: str = ""  # the incident's first cause at the end (kind), "" if none
    right: bool = False
    xid_only_right: bool = False  # what the previous release's join (Xids only) would name
    pages: int = 0  # critical JobHangSuspected alerts opened
    cpu: float = 0.0
    simulated: float = 0.0
    headline: str = ""
    first_critical: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def recordings(kind: str) -> list[str]:
    """The real recordings of `kind`; those synthesized from others (PROVENANCE.md) are not."""
    out = []
    for path in sorted(glob.glob(os.path.join(FIXTURES, "*", "expect.json"))):
        prov = Path(path).parent / "PROVENANCE.md"
        if prov.exists() and "SYNTHESIZED" in prov.read_text().split("\n", 1)[0]:
            continue
        if Expect.load(path).kind == kind:
            out.append(os.path.dirname(path))
    return out


def _gpus_of(trace: Trace) -> tuple[list[int], dict[int, int]]:
    """The job's GPUs and pid -> GPU, from the recorded NVML process lists."""
    gpus: set[int] = set()
    of: dict[int, int] = {}
    pids = set(trace.pids.values())
    for row in trace.nvml:
        for g in row["gpus"]:
            for p in g["processes"]:
                if int(p) in pids:
                    gpus.add(int(g["gpu"]))
                    of[int(p)] = int(g["gpu"])
    return sorted(gpus), of


def _target(trace: Trace) -> tuple[int, int]:
    """(rank, pid) of the rank that stopped first: one that died, else rank 0."""
    last = trace.doc["samples"][-1]["ranks"]
    for rank, pid in sorted(trace.pids.items()):
        if last.get(str(rank), {}).get("state") in (None, "Z", "X", "gone"):
            return rank, pid
    rank = min(trace.pids)
    return rank, trace.pids[rank]


def replay(
    tmp: str,
    directory: str,
    phase: float,
    seed: int,
    kind: str = "",
    offset: float = 0.0,
) -> Outcome:
    """One recording at one NVML phase, with one fault of `kind` ("" for none) and noise."""
    trace = Trace(directory)
    want = Expect.load(os.path.join(directory, "expect.json"))  # its hangs_config (stacks)
    rows = trace.samples()
    t_first, t_last = rows[0][0], rows[-1][0]
    origin = trace.hang_start if trace.hang_start is not None else trace.origin
    rng = random.Random(seed)
    gpus, gpu_of = _gpus_of(trace)
    rank, pid = _target(trace)
    target_gpu = gpu_of.get(pid, gpus[0] if gpus else 0)
    # the sources run from two minutes before the recording: every one has polled before
    # the earliest fault (a counter already risen at a source's first poll is old news)
    feed = NodeFeed(Path(tmp), gpus or [0], target_gpu, t_first - 120.0, rng)
    feed.noise(t_last + 1.0)
    if kind:
        feed.inject(kind, origin + offset, pid)
    out = Outcome(simulated=t_last - t_first)
    opened: set[tuple[object, float]] = set()
    with replaying(tmp, trace, phase, want.config()) as node:
        monitor = node.monitor
        for t, ranks in rows:
            node.clock.advance(t - node.clock.time())
            for src, events in feed.due(t):
                c0 = time.thread_time()
                monitor.on_publish(EMPTY, src, events)
                out.cpu += time.thread_time() - c0
            _step(node, trace, t, ranks, out)
            monitor.run_pending()  # the forensics thread's work (early stacks), in this one
            found = monitor.findings()
            if not found:
                continue
            at = t - origin
            if out.detected is None:
                out.detected = at
            for f in found:
                key = (f.subject, f.since)
                if f.severity >= Severity.CRITICAL and key not in opened:
                    opened.add(key)
                    out.pages += 1
                    if out.first_critical is None:
                        out.first_critical = at
            if kind and out.named is None:
                doc = monitor.records()[0]
                first = (doc.get("causes") or {}).get("cause") or {}
                ok = first.get("kind") == kind
                if ok and kind in PID_CLASSES:
                    ok = first.get("pid") == pid and first.get("rank") == rank
                if ok:
                    out.named = at
        docs = monitor.records()
    if docs:
        inc = docs[0].get("causes") or {}
        first = inc.get("cause") or {}
        out.cause = str(first.get("kind") or "")
        out.headline = str(inc.get("headline") or "")
        out.right = bool(kind) and out.named is not None and out.cause == kind
        # The previous join: an Xid on the rank's GPU or from its pid, at most 5 s after
        # the verdict's since; it named no other class.
        since = float(docs[0].get("since") or 0.0)
        out.xid_only_right = kind in XID_LINES and origin + offset <= since + 5.0
    return out


def _step(
    node: Replay, trace: Trace, t: float, ranks: dict[int, dict[str, Any]], out: Outcome
) -> None:
    """Replay.step, with only the monitor's own calls on the CPU clock."""
    node.proc.write(node.boot + t - node.launch, ranks)
    node.srv.json_answer = trace.ras_answer(t, "json") or trace.first_ras_answer("json")
    node.srv.text_answer = trace.ras_answer(t, "text") or trace.first_ras_answer("text")
    c0 = time.thread_time()
    if t >= node.next_nvml:
        node.next_nvml += NVML_INTERVAL
        since, node.last_nvml = node.last_nvml, t  # GPM over the poll's interval
        node.monitor.on_publish(nvml_snapshot(trace.nvml_poll(since, t), t))
    node.monitor.tick()
    out.cpu += time.thread_time() - c0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def faults(quick: bool, seed: int) -> list[tuple[str, str, float, float, Outcome, bool]]:
    """(recording, class, offset, phase, outcome, dead) for every fault case."""
    out = []
    rng = random.Random(seed)
    recs = recordings("hang")
    for directory in recs:
        want = Expect.load(os.path.join(directory, "expect.json"))
        dead = bool(set(want.conditions_any) & DEAD)
        phases = want.nvml_phases[:1] if quick else want.nvml_phases
        for phase in phases:
            for kind in CLASSES:
                if kind in ("oom_kill", "segfault", "trap") and not dead:
                    continue  # the kernel kills only where a rank died
                offsets = (OFFSETS[1], OFFSETS[2]) if quick else OFFSETS
                for offset in offsets:
                    with tempfile.TemporaryDirectory() as tmp:
                        got = replay(
                            tmp, directory, float(phase), rng.randrange(1 << 30), kind, offset
                        )
                    out.append((os.path.basename(directory), kind, offset, float(phase), got, dead))
    return out


def controls(quick: bool, seed: int, draws: int) -> dict[tuple[str, float], list[Outcome]]:
    """Every control at every NVML phase, `draws` noise draws each."""
    rng = random.Random(seed)
    out: dict[tuple[str, float], list[Outcome]] = {}
    phases = (0.0, 5.0) if quick else tuple(float(p) for p in range(0, int(NVML_INTERVAL), 2))
    for directory in recordings("control"):
        for phase in phases:
            for _ in range(1 if quick else draws):
                with tempfile.TemporaryDirectory() as tmp:
                    got = replay(tmp, directory, phase, rng.randrange(1 << 30))
                out.setdefault((os.path.basename(directory), phase), []).append(got)
    return out


def node_days(
    episodes: dict[tuple[str, float], list[Outcome]], days: float, seed: int
) -> dict[str, float]:
    """Pages and CPU over `days` simulated node-days built from the replayed episodes."""
    rng = random.Random(seed)
    names = sorted({name for name, _ in episodes})
    pages = 0
    cpu = 0.0
    simulated = 0.0
    count = 0
    for prefix, per_day in DAY.items():
        pool = [k for k in episodes if k[0].startswith(prefix)]
        if not pool:
            continue
        n = int(round(per_day * days))
        for _ in range(n):
            draw = rng.choice(episodes[rng.choice(pool)])
            pages += draw.pages
            cpu += draw.cpu
            simulated += draw.simulated
            count += 1
    noise_free = all(len({o.pages for o in v}) == 1 for v in episodes.values())
    return {
        "episodes": count,
        "pages": pages,
        "pages_per_node_day": pages / days,
        "cpu_per_simulated_hour": cpu / simulated * 3600 if simulated else 0.0,
        "pages_independent_of_noise": noise_free,
        "recordings": len(names),
    }


def summarize(cases: list[tuple[str, str, float, float, Outcome, bool]]) -> dict[str, Any]:
    per: dict[str, dict[str, Any]] = {}
    for kind in CLASSES:
        got = [c for c in cases if c[1] == kind]
        if not got:
            continue
        named = [c[4].named for c in got if c[4].named is not None]
        lag = [
            c[4].named - c[4].detected
            for c in got
            if c[4].named is not None and c[4].detected is not None
        ]
        per[kind] = {
            "faults": len(got),
            "right": sum(c[4].right for c in got),
            "named_p50_s": pct(named, 0.5),
            "named_p90_s": pct(named, 0.9),
            "named_after_detect_p90_s": pct(lag, 0.9),
            "wrong": dict(Counter(c[4].cause or "none" for c in got if not c[4].right)),
        }
    detect: dict[str, list[float]] = {"dead": [], "stall": []}
    missed: Counter[str] = Counter()
    by_rec: dict[str, list[float]] = {}
    for rec, _kind, _off, _ph, o, dead in cases:
        bucket = "dead" if dead else "stall"
        if o.detected is None:
            missed[rec] += 1
        else:
            detect[bucket].append(o.detected)
            by_rec.setdefault(rec, []).append(o.detected)
    total = len(cases)
    right = sum(c[4].right for c in cases)
    xid_only = sum(c[4].xid_only_right for c in cases)
    cpu = sum(c[4].cpu for c in cases)
    sim = sum(c[4].simulated for c in cases)
    return {
        "faults": total,
        "right": right,
        "right_share": right / total if total else 0.0,
        "xid_only_right": xid_only,
        "classes": per,
        "detect_dead_p50_s": pct(detect["dead"], 0.5),
        "detect_dead_p90_s": pct(detect["dead"], 0.9),
        "detect_stall_p50_s": pct(detect["stall"], 0.5),
        "detect_stall_p90_s": pct(detect["stall"], 0.9),
        "not_detected": dict(missed),
        "detect_by_recording": {
            r: (min(v), pct(v, 0.5), max(v)) for r, v in sorted(by_rec.items())
        },
        "cpu_per_simulated_hour_faults": cpu / sim * 3600 if sim else 0.0,
    }


def hgx_reader_cost(runs: int) -> dict[str, float]:
    """The cause memory's thread CPU per poll of the 8-GPU HGX node's NVML and InfiniBand
    sources (the real sources' samples), and per hour at their default intervals."""
    with tempfile.TemporaryDirectory() as tmp:
        nvml, ib = hgx_polls(Path(tmp))
    mem = CauseMemory()
    cost: dict[str, float] = {}
    for snap in (nvml, ib):
        took = []
        for i in range(runs):
            polled = dataclasses.replace(snap, timestamp=snap.timestamp + i + 1)
            c0 = time.thread_time()
            mem.note(polled, (), polled.timestamp)
            took.append(time.thread_time() - c0)
        cost[snap.source] = statistics.median(took)
        cost[f"{snap.source}_samples"] = len(snap.samples)
    cost["per_hour"] = sum(3600.0 / INTERVALS[s] * cost[s] for s in ("nvml", "infiniband"))
    return cost


def _row(name: str, value: str) -> str:
    return f"| {name} | {value} |"


def _goal(name: str, value: float | None, limit: float, unit: str = " s") -> str:
    if value is None:
        return _row(f"goal: {name} <= {limit:g}{unit}", "not measured")
    met = "met" if value <= limit else "NOT met"
    return _row(f"goal: {name} <= {limit:g}{unit}", f"{met} ({value:.4g}{unit})")


def table(fig: dict[str, Any], days: float) -> list[str]:
    """The rows of the docs/benchmarks.md section."""
    nf = fig["no_fault"]
    dead = f"{_s(fig['detect_dead_p50_s'])} / {_s(fig['detect_dead_p90_s'])}"
    stall = f"{_s(fig['detect_stall_p50_s'])} / {_s(fig['detect_stall_p90_s'])}"
    rows = [
        _row("faults (hang recordings x NVML phases x classes x offsets)", str(fig["faults"])),
        _row("cause named right", f"{fig['right']} of {fig['faults']} ({fig['right_share']:.1%})"),
        _row(
            "the same faults named right by the previous join (Xids only)",
            f"{fig['xid_only_right']} ({fig['xid_only_right'] / max(1, fig['faults']):.1%})",
        ),
        _row("hang detected, dead or killed rank: p50 / p90", dead),
        _row("hang detected, stalls: p50 / p90", stall),
    ]
    for rec, (lo, mid, hi) in fig["detect_by_recording"].items():
        rows.append(
            _row(f"hang detected, {rec}: min / p50 / max", f"{_s(lo)} / {_s(mid)} / {_s(hi)}")
        )
    for kind, c in fig["classes"].items():
        wrong = ", ".join(f"{k} {n}" for k, n in sorted(c["wrong"].items()))
        named = f"{_s(c['named_p50_s'])} / {_s(c['named_p90_s'])}"
        after = _s(c["named_after_detect_p90_s"])
        value = f"{c['right']}/{c['faults']} right; {named}; {after}"
        if wrong:
            value += f"; wrong as: {wrong}"
        rows.append(_row(f"{kind}: right; named p50 / p90; p90 after detection", value))
    cpu_nf, cpu_f = nf["cpu_per_simulated_hour"], fig["cpu_per_simulated_hour_faults"]
    hx = fig["hgx_reader"]
    rows += [
        _row(
            "no fault: simulated node-days",
            f"{days:g} ({nf['episodes']} episodes of {nf['recordings']} recordings)",
        ),
        _row(
            "no fault: critical pages", f"{nf['pages']} ({nf['pages_per_node_day']:.4f}/node-day)"
        ),
        _row(
            "no fault: pages the same for every noise draw", str(nf["pages_independent_of_noise"])
        ),
        _row("hang path CPU / simulated hour, no fault", f"{cpu_nf:.2f} s ({cpu_nf / 36:.3f} %)"),
        _row("hang path CPU / simulated hour, faults", f"{cpu_f:.2f} s ({cpu_f / 36:.3f} %)"),
        _row(
            "cause memory on an 8-GPU HGX node: one NVML poll / one InfiniBand poll (p50)",
            f"{hx['nvml'] * 1e3:.2f} ms ({hx['nvml_samples']:.0f} samples) / "
            f"{hx['infiniband'] * 1e3:.2f} ms ({hx['infiniband_samples']:.0f} samples)",
        ),
        _row(
            "the same per hour at the default intervals",
            f"{hx['per_hour']:.2f} s ({hx['per_hour'] / 36:.3f} % of a core)",
        ),
        _goal("dead or killed rank detected, p90", fig["detect_dead_p90_s"], 15.0),
        _goal("stall detected, p90", fig["detect_stall_p90_s"], 30.0),
        _row(
            "goal: cause named right >= 90 %",
            f"{'met' if fig['right_share'] >= 0.9 else 'NOT met'} ({fig['right_share']:.1%})",
        ),
        _goal("false pages per node-day", nf["pages_per_node_day"], 0.001, ""),
        _row("wall time of the run", f"{fig['wall_seconds']:.0f} s"),
    ]
    return rows


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one phase, two offsets, one draw")
    ap.add_argument("--node-days", type=float, default=100.0)
    ap.add_argument("--draws", type=int, default=3, help="noise draws per control episode")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    wall = time.monotonic()
    fault_cases = faults(args.quick, args.seed)
    fig = summarize(fault_cases)
    episodes = controls(args.quick, args.seed + 1, args.draws)
    fig["no_fault"] = node_days(episodes, args.node_days, args.seed + 2)
    fig["hgx_reader"] = hgx_reader_cost(20 if args.quick else 200)
    fig["wall_seconds"] = time.monotonic() - wall
    rows = table(fig, args.node_days)
    section = "" if args.no_write or args.quick else "hang-causes"
    publish(fig, "Hang causes: fault-injection benchmark", rows, section, args.json)


if __name__ == "__main__":
    main()
