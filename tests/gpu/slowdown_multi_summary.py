"""summary.json of the multi-GPU slowdown run (tests/gpu/slowdown_multi.py), from its files.

Per phase: steps per rank, the job's step time (the slowest rank's mean: a synchronous
job steps at its pace), its step rate against base, the daemon's polls and the GPUs any
JobSlowedByGpu named. Per slowed phase: seconds from its start to the first alert naming
the slow rank's GPU, the alert's estimate ("about N % slower", /status's `slowdown`)
against the measured step ratio less one. False alerts: any JobSlowedByGpu in base, in
a daemon_on window, in a back phase after --clear seconds (the slow phase's alert takes
a window and a release to resolve), or naming another GPU. The cost: 1 less the job's
step rate with the daemon running over its rate with it stopped, over the alternating
windows (--settle seconds left out at each window's start, for the daemon's start-up).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

ALERTNAME = "JobSlowedByGpu"
ABOUT = re.compile(r"about (\d+)% slower")


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    phases = _rows(out / "phases.jsonl")
    polls = _rows(out / "polls.jsonl")
    steps = {r: _rows(out / f"steps-rank{r}.jsonl") for r in range(args.ranks)}
    expected = str(args.slow_rank)  # CUDA_DEVICE_ORDER=PCI_BUS_ID: rank R on NVML GPU R
    rows: dict[str, dict[str, Any]] = {}
    for i, ph in enumerate(phases):
        name, start = ph["phase"], ph["t"]
        end = phases[i + 1]["t"] if i + 1 < len(phases) else float("inf")
        per_rank = {}
        for r, got in steps.items():
            times = [s["s"] for s in got if s["phase"] == name and s["t"] >= start + args.settle]
            per_rank[r] = _mean(times)
        means = [m for m in per_rank.values() if m is not None]
        inside = [p for p in polls if start <= p["t"] < end and p.get("daemon")]
        answered = [p for p in inside if "error" not in p]
        named = sorted({a["gpu"] for p in inside for a in p.get("alerts", [])})
        rows[name] = {
            "t": start,
            "extra": ph["extra"],
            "steps": {
                str(r): sum(1 for s in got if s["phase"] == name) for r, got in steps.items()
            },
            "job_step_s": max(means) if len(means) == len(per_rank) else None,
            "polls": len(answered),
            "poll_errors": len(inside) - len(answered),
            "alert_gpus": named,
        }
    base = (rows.get("base") or {}).get("job_step_s")
    for r in rows.values():
        if base and r["job_step_s"]:
            r["step_ratio"] = r["job_step_s"] / base
            r["rate_vs_base"] = base / r["job_step_s"]
    slowed, false_alerts = {}, []
    for i, ph in enumerate(phases):
        name, start = ph["phase"], ph["t"]
        end = phases[i + 1]["t"] if i + 1 < len(phases) else float("inf")
        inside = [p for p in polls if start <= p["t"] < end and p.get("alerts")]
        if name.startswith("slow"):
            right = [p for p in inside if any(a["gpu"] == expected for a in p["alerts"])]
            wrong = sorted({a["gpu"] for p in inside for a in p["alerts"]} - {expected})
            first = right[0]["t"] - start if right else None
            about = [
                int(m.group(1)) / 100
                for p in right
                for a in p["alerts"]
                if a["gpu"] == expected and (m := ABOUT.search(a["description"]))
            ]
            status = [
                j["slowdown"]
                for p in right
                for j in (p.get("slowdowns") or {}).values()
                if j.get("slowed") and j.get("slowest") == expected
            ]
            measured = rows[name].get("step_ratio")
            slowed[name] = {
                "extra": ph["extra"],
                "seconds_to_alert": round(first, 1) if first is not None else None,
                "within_goal": first is not None and first <= args.within,
                "wrong_gpus": wrong,
                "causes": sorted({a["cause"] for p in right for a in p["alerts"]}),
                "alert_estimate": statistics.median(about) if about else None,
                "status_estimate": statistics.median(status) if status else None,
                "measured_slowdown": measured - 1 if measured else None,
            }
            false_alerts += [{"phase": name, "gpu": g} for g in wrong]
        elif name == "base" or name.startswith(("back", "daemon_on")):
            grace = args.clear if name.startswith("back") else 0.0
            late = [p for p in inside if p["t"] >= start + grace]
            gpus = sorted({a["gpu"] for p in late for a in p["alerts"]})
            false_alerts += [{"phase": name, "gpu": g, "t": late[0]["t"]} for g in gpus]
    on = [r["job_step_s"] for n, r in rows.items() if n.startswith("daemon_on")]
    off = [r["job_step_s"] for n, r in rows.items() if n.startswith("daemon_off")]
    cost = None
    if on and off and None not in on and None not in off:
        cost = 1 - statistics.fmean(off) / statistics.fmean(on)  # 1 - rate_on / rate_off
    goals: dict[str, bool | None] = {
        "named_within": bool(slowed) and all(s["within_goal"] for s in slowed.values()),
        "no_false_alert": not false_alerts,
        "cost_under": cost < args.max_cost if cost is not None else None,
    }
    plumbing = (
        bool(phases)
        and all(all(r["steps"].values()) for r in rows.values())
        and all(r["polls"] for n, r in rows.items() if not n.startswith("daemon_"))
    )
    judged = [v for v in goals.values() if v is not None]
    return {
        "dry_run": args.dry_run,
        "ranks": args.ranks,
        "slow_rank": args.slow_rank,
        "slow_gpu": expected,
        "phases": rows,
        "slowed": slowed,
        "false_alerts": false_alerts,
        "daemon_cost": cost,
        "goals": {
            "within_seconds": args.within,
            "max_cost": args.max_cost,
            **goals,
        },
        "plumbing_ok": plumbing,
        # a replay does not follow the job: a dry run judges the plumbing only
        "ok": plumbing and (args.dry_run or all(judged)),
    }
