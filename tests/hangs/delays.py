"""Every recorded scenario replayed at each of the ten NVML phases: when it pages, and how.

    python -m tests.hangs.delays [--stacks] [--json OUT] [NAME ...]

Prints, per fixture of tests/fixtures/hangs/*/ (those with an expect.json), the seconds
from the hang's start (a control: its pause, else readiness) to the first finding at
each NVML phase 0..9, the first finding's severity and the signature it ends with;
`--stacks` replays with `hangs.stacks` on (the recorded py-spy dumps answer the
monitor's captures). A before/after comparison of a detector change is two runs of this.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import sys
import tempfile
from typing import Any

from gpuwatchd.config import Config
from tests.hangs.real_trace import Trace
from tests.hangs.replay import FIXTURES
from tests.hangs.scenario_replay import replaying

PHASES = tuple(range(10))


def config(stacks: bool) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, hangs=dataclasses.replace(cfg.hangs, stacks=stacks))


def one(directory: str, phase: int, stacks: bool) -> dict[str, Any]:
    """The first finding of one replay (None when nothing was found) and its last signature."""
    trace = Trace(directory)
    with (
        tempfile.TemporaryDirectory() as tmp,
        replaying(tmp, trace, float(phase), config(stacks)) as node,
    ):
        node.run()
    flagged = [(t, f) for t, found in node.ticks for f in found]
    if not flagged:
        return {"phase": phase, "first": None}
    t, f = flagged[0]
    labels = dict(flagged[-1][1].labels)
    return {
        "phase": phase,
        "first": round(t, 1),
        "severity": f.severity.name.lower(),
        "signature": labels.get("signature", ""),
        "conditions": sorted({c for d in node.monitor.records() for c in d["conditions"]}),
    }


def fixtures(names: list[str]) -> list[str]:
    found = sorted(
        os.path.dirname(p) for p in glob.glob(os.path.join(FIXTURES, "*", "expect.json"))
    )
    return [d for d in found if not names or os.path.basename(d) in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="fixture directory names (default: all)")
    ap.add_argument("--stacks", action="store_true", help="replay with hangs.stacks on")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the monitor's own log lines, one per hang
    rows = []
    for d in fixtures(args.names):
        with open(os.path.join(d, "expect.json")) as f:
            kind = json.load(f)["kind"]
        runs = [one(d, p, args.stacks) for p in PHASES]
        times = [r["first"] for r in runs if r["first"] is not None]
        sigs = sorted({r.get("signature", "") for r in runs if r["first"] is not None})
        sevs = sorted({r.get("severity", "") for r in runs if r["first"] is not None})
        span = f"{min(times):+.1f}..{max(times):+.1f} s" if times else "none"
        print(
            f"{os.path.basename(d):32s} {kind:7s} flagged {len(times):2d}/10  {span:18s}"
            f" {','.join(sevs) or '-':17s} {','.join(sigs) or '-'}",
            flush=True,
        )
        rows.append({"fixture": os.path.basename(d), "kind": kind, "runs": runs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
