"""Evidence bundles in a cascade: what the consumer thread waits, and the kernel log's tail.

A file-backend kernel log of `--mib` MiB (128-byte lines) and `--incidents`
critical findings handed to the evidence listener at once, as a GPU falling
off the bus raises them. Measured: how long the listener holds its caller
(the consumer thread), how long until every bundle is written or dropped,
and the cost of the newest `evidence.kmsg_records` lines against what an
operator would run for them, `tail -n 2000` (coreutils, same file).

    .venv/bin/python benchmarks/bench_evidence.py [--mib 314] [--incidents 60] [--section NAME]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import publish  # noqa: E402
from gpuwatchd import config  # noqa: E402
from gpuwatchd.model import Action, Finding, Severity, labels_of  # noqa: E402
from gpuwatchd.sinks.evidence import EvidenceRecorder, read_kmsg  # noqa: E402

LINE = b"Nov 29 00:00:00 node kernel: " + b"x" * 98 + b"\n"


def _findings(n: int) -> list[Finding]:
    return [
        Finding(
            rule="xid",
            alertname="GpuXidCritical",
            scope="gpu",
            subject=labels_of({"gpu": str(g), "pci_bus_id": f"0000:{g:02x}:00.0"}),
            severity=Severity.CRITICAL,
            reason="Xid 79: fallen off the bus",
            action=Action.REBOOT_NODE,
            remediation="reboot",
            since=1.0,
        )
        for g in range(n)
    ]


def _best(runs: int, fn: object) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=314)
    ap.add_argument("--incidents", type=int, default=60)
    ap.add_argument("--section", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        kern = d / "kern.log"
        block = LINE * ((1 << 20) // len(LINE))  # 1 MiB of whole lines
        with kern.open("wb") as f:
            for _ in range(args.mib):
                f.write(block)
        (d / "c.yaml").write_text(
            f"daemon: {{state_dir: {d / 'state'}}}\npaths: {{kmsg: {kern}}}\n"
            f"evidence: {{max_bundles: {args.incidents}}}\n"
        )
        cfg = config.load(str(d / "c.yaml"))
        rec = EvidenceRecorder(cfg, None)
        rec.start()
        began = time.perf_counter()
        rec.update(_findings(args.incidents))
        held = time.perf_counter() - began
        rec.stop(timeout=600)
        done = time.perf_counter() - began
        written = {s.name: s.value for s in rec.samples() if not s.labels}
        ours = _best(5, lambda: read_kmsg(str(kern), 2000))
        tail = shutil.which("tail")
        theirs = (
            _best(5, lambda: subprocess.run([tail, "-n", "2000", str(kern)], capture_output=True))
            if tail
            else float("nan")
        )
    fig = {
        "kern_log_mib": args.mib,
        "incidents": args.incidents,
        "listener_seconds": round(held, 4),
        "all_bundles_seconds": round(done, 3),
        "bundles_written": written.get("gpuwatchd_evidence_bundles_written_total", 0.0),
        "tail_2000_ours_ms": round(ours * 1000, 2),
        "tail_2000_coreutils_ms": round(theirs * 1000, 2),
    }
    rows = [
        f"| kernel log | {args.mib} MiB file, 128-byte lines |",
        f"| critical incidents at once | {args.incidents} |",
        f"| listener held the consumer thread | {held * 1000:.1f} ms |",
        f"| every bundle written | {done:.2f} s ({fig['bundles_written']:.0f} bundles) |",
        f"| newest 2,000 lines, read from the end | {ours * 1000:.2f} ms |",
        f"| `tail -n 2000` on the same file | {theirs * 1000:.2f} ms"
        f" (ours takes {ours / theirs:.2f}x its time) |",
    ]
    publish(fig, "Evidence bundles in a cascade", rows, args.section, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
