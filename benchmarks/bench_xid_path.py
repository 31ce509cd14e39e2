"""What one kernel Xid report costs on its way through the source and the Xid stage.

A flood of Xid lines (Xid 31, 13 and 79 in turn, 50 pids, one GPU) in a
file is read by the kernel log source (parse, event, attribution against an
empty /proc) and handed to the Xid stage (MIG and workload steps, NVML
merge, line joining, classification; no store), the costliest path a
flood takes. Each revision runs in a process of its own, alternately, and
the best of each is kept (the machine is shared); `--baseline-rev` runs the
same flood on an earlier revision's package, unpacked with `git archive`.

    .venv/bin/python benchmarks/bench_xid_path.py [--reports 20000] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import publish  # noqa: E402

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config, KmsgConfig, PathsConfig, SourcesConfig
from gpuwatchd.health.xid.catalog import default_catalog
from gpuwatchd.health.xid.merge import XidMerger
from gpuwatchd.health.xid.stage import XidStage
from gpuwatchd.health.xid.tracker import TrackerSettings, XidTracker
from gpuwatchd.model import Event, KmsgState, SourceSnapshot
from gpuwatchd.sources.kmsg.filereader import FileReader
from gpuwatchd.sources.kmsg.source import KmsgSource
from gpuwatchd.state import NodeSnapshot
import gpuwatchd.sources as sources

n = int(sys.argv[2])
with tempfile.TemporaryDirectory() as d:
    tmp = Path(d)
    (tmp / "proc").mkdir()
    (tmp / "boot_id").write_text("6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001\n")
    log = tmp / "flood.txt"
    log.write_text("".join(
        f"[{100 + i * 0.001:.6f}] NVRM: Xid (PCI:0000:3b:00): {(31, 13, 79)[i % 3]},"
        f" pid={1000 + i % 50}, name=python3, detail {i}\n" for i in range(n)
    ))
    cfg = Config(
        paths=PathsConfig(
            kmsg=str(tmp / "unused"), boot_id=str(tmp / "boot_id"), procfs=str(tmp / "proc")
        ),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="kmsg")),
    )
    clock = FakeClock()
    src = KmsgSource(
        cfg, sources.SourceContext(clock=clock, one_shot=True),
        opener=lambda cur: FileReader(str(log), None, sleep=lambda s: None), sleep=lambda s: None,
    )
    stage = XidStage(XidTracker(default_catalog(), TrackerSettings(), "b"), XidMerger(), None,
                     lambda o, s: None, clock)
    stage.log_reports = False
    t0 = time.perf_counter()
    events = []
    while len(events) < n:
        got = [e for e in src.poll(clock.time()) if isinstance(e, Event)]
        if not got:
            break
        events += got
    t1 = time.perf_counter()
    kmsg = SourceSnapshot("kmsg", (), True, payload=KmsgState(reader_up=True))
    stage.on_publish(NodeSnapshot(), kmsg, tuple(events))
    t2 = time.perf_counter()
print(json.dumps({"reports": len(events), "source": (t1 - t0) / n, "stage": (t2 - t1) / n}))
"""


@contextmanager
def revision(rev: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-xid-rev-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "gpuwatchd"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield Path(tmp)


def run_once(tree: Path, reports: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(reports)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline-rev", default="")
    ap.add_argument("--section", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    with revision(args.baseline_rev or "HEAD") as old:
        if args.baseline_rev:
            trees[f"revision {args.baseline_rev}"] = old
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.runs):
            for name, tree in trees.items():
                got = run_once(tree, args.reports)
                got["total"] = got["source"] + got["stage"]
                if name not in best or got["total"] < best[name]["total"]:
                    best[name] = got
    fig: dict[str, object] = {"reports": args.reports}
    rows = []
    for name, b in best.items():
        us = {k: round(v * 1e6, 1) for k, v in b.items() if k != "reports"}
        fig[name] = us
        rows.append(
            f"| µs per Xid report, {name}: source, stage, total"
            f" | {us['source']}, {us['stage']}, {us['total']} |"
        )
    if args.baseline_rev:
        ratio = best["this tree"]["total"] / best[f"revision {args.baseline_rev}"]["total"]
        fig["ratio_to_baseline"] = round(ratio, 2)
        rows.append(f"| this tree / revision {args.baseline_rev} | {ratio:.2f} |")
    publish(fig, "Xid path per report", rows, args.section, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
