#!/usr/bin/env python3
"""Real NCCL hang scenarios and quiet controls on a multi-GPU node, beside a running gpuwatchd.

    python3 tests/gpu/nccl_scenarios.py --out DIR [--daemon-url URL] [NAME|SUITE ...]
    python3 tests/gpu/nccl_scenarios.py --plan [NAME|SUITE ...]     schedule and total time
    python3 tests/gpu/nccl_scenarios.py --dry-run --out DIR ...     fake ranks, no GPU

Each scenario (nccl_run.py) starts its job (tests/gpu/nccl_jobs.py) with
`torchrun --standalone` or by hand, on GPUs of its own (several scenarios run
at once), waits for the ranks' markers, then once a second reads every rank's
/proc/PID/stat and /proc/PID/io, every 5 s the job's NCCL RAS answer, and on a
hang (or a control's pause) triggers the PyTorch flight recorder 20 s in and
takes two py-spy dumps 5 s apart. Meanwhile it polls the daemon's /hangs,
/alerts and /metrics every 2 s and reads NVRM lines from /dev/kmsg. Per
scenario it writes DIR/NAME/trace.json (timeline, RAS answers as received,
dumps, the daemon's first record and alert, seconds from hang start);
DIR/summary.json holds one row per scenario. Every child runs in its own
session and is killed at the end; every wait has a deadline; --budget stops
starting scenarios that would not finish in time and ends the rest at the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))

from nccl_observe import DaemonPoller, KmsgReader, NvmlSampler  # noqa: E402
from nccl_plan import Scenario, devices, expand, parser, plan, short_watch, too_wide  # noqa: E402
from nccl_rank import MULTICAST_OFF  # noqa: E402
from nccl_run import Run  # noqa: E402


class Context:
    def __init__(self, args: argparse.Namespace) -> None:
        self.stop = threading.Event()
        self.kmsg = KmsgReader()
        self.nvml = NvmlSampler(args.out)
        self.daemon = (
            DaemonPoller(args.daemon_url, args.out, args.daemon_poll) if args.daemon_url else None
        )


def execute(scens: list[Scenario], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ctx = Context(args)
    ctx.kmsg.start()
    if not args.dry_run:
        ctx.nvml.start()
    if ctx.daemon:
        ctx.daemon.start()
    deadline = time.monotonic() + args.budget
    free = list(range(args.gpus))
    for s in scens:  # never started on GPUs that are not there
        if too_wide(s, args.gpus):
            rows.append({"scenario": s.name, "skipped": too_wide(s, args.gpus)})
            print(f"skip {s.name}: {too_wide(s, args.gpus)}", flush=True)
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    pending = [s for s in scens if not too_wide(s, args.gpus)]

    def worker(s: Scenario, gpus: list[int]) -> None:
        try:
            row = Run(s, gpus, args, ctx).run()
        except Exception as e:  # the GPUs go back and the other scenarios go on
            row = {"scenario": s.name, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row, default=str), flush=True)
        with lock:
            rows.append(row)
            free.extend(gpus)

    while pending or any(t.is_alive() for t in threads):
        left = deadline - time.monotonic()
        if left <= 0:
            ctx.stop.set()
            break
        with lock:
            for s in list(pending):
                est = s.estimate(args.hang_seconds, args.control_seconds, args.settle)
                if est > left:
                    pending.remove(s)
                    rows.append({"scenario": s.name, "skipped": f"needs ~{est:.0f} s"})
                elif len(free) >= s.gpus:
                    gpus = sorted(free)[: s.gpus]
                    for g in gpus:
                        free.remove(g)
                    pending.remove(s)
                    print(f"{time.strftime('%H:%M:%S')} start {s.name} on GPUs {gpus}", flush=True)
                    th = threading.Thread(target=worker, args=(s, gpus), name=s.name)
                    th.start()
                    threads.append(th)
        time.sleep(0.5)
    for th in threads:  # each run ends within its kill grace once stop is set
        th.join(60)
    ctx.stop.set()
    ctx.kmsg.stop_event.set()
    ctx.nvml.stop_event.set()
    if ctx.daemon:
        ctx.daemon.stop()
    meta = {
        "kmsg_error": ctx.kmsg.error,
        "nvml_error": ctx.nvml.error,
        "daemon_polls": ctx.daemon.polls if ctx.daemon else 0,
        "daemon_errors": ctx.daemon.errors if ctx.daemon else 0,
    }
    rows.append({"meta": meta, "hung_threads": [t.name for t in threads if t.is_alive()]})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    scens = expand(args.names, args)
    if args.dry_run and args.gpus is None:
        args.gpus = 4  # fake ranks need no GPU
    args.devices, args.gpu_source = devices(args.gpus, fake=args.plan or args.dry_run)
    args.gpus = len(args.devices)
    rows = plan(scens, args.gpus, args)
    total = max((r.get("end", 0.0) for r in rows), default=0.0)
    warnings = short_watch(args.hang_seconds)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr, flush=True)
    if args.plan:
        for r in rows:
            if "skipped" in r:
                print(f"  skip  {r['skipped']}  {r['name']}")
            else:
                print(f"{r['start']:6.0f} {r['end']:6.0f} s  GPUs {r['gpus']}  {r['name']}")
        mins = f"{total / 60:.1f} min"
        how = f"{args.gpus} GPUs ({args.gpu_source})"
        print(f"total ~{total:.0f} s ({mins}) on {how}; budget {args.budget:.0f} s")
        return 0
    os.environ.update(MULTICAST_OFF)
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    result = execute(scens, args)
    summary = {
        "started": started,
        "seconds": round(time.time() - started, 1),
        "planned_seconds": round(total),
        "args": vars(args),
        "warnings": warnings,
        "rows": result,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"summary: {os.path.join(args.out, 'summary.json')} ({summary['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
