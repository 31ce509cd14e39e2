"""Generate the Grafana dashboards in deploy/grafana/ with grafana-foundation-sdk.

The panels are data (the NODE and FLEET tables of dashboard_node.py and
dashboard_fleet.py); the SDK's typed builders in dashboard_panels.py turn them
into dashboard JSON that follows Grafana's schema. A test fails when the files
are stale.

    python scripts/gen_dashboards.py            # rewrite deploy/grafana/*.json and the chart copies
    python scripts/gen_dashboards.py --check    # exit 1 if any is stale

Every query is scoped with `cluster=~"$cluster", node=~"$node",
instance=~"$instance"`. Without the ServiceMonitor's `node` relabelling (or
without a `cluster` external label) the variables offer nothing but All
(`.*`), which also matches a missing label, and `$instance` picks the target;
tables group by `instance` as well as `node` so nodes stay apart either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dashboard_fleet import FLEET
from dashboard_node import NODE
from dashboard_panels import build

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana"
CHART_COPY = ROOT / "deploy" / "helm" / "gpuwatchd" / "files" / "dashboards"

DASHBOARDS = {
    "gpuwatchd-node": (
        "gpuwatchd / Node",
        "One GPU node: health verdicts, thermals, memory errors, NVLink, PCIe, Xids, /dev/shm,"
        " InfiniBand, who runs on each GPU, and the daemon itself.",
        NODE,
        True,
    ),
    "gpuwatchd-fleet": (
        "gpuwatchd / Fleet",
        "All GPU nodes: nodes by health, GPUs worst first, top Xids across the fleet, jobs hit,"
        " hangs suspected, top offenders.",
        FLEET,
        False,
    ),
}


def render() -> dict[str, str]:
    """File name -> JSON text for every dashboard."""
    return {
        f"{uid}.json": json.dumps(build(uid, *spec), indent=2, sort_keys=True) + "\n"
        for uid, spec in DASHBOARDS.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = ap.parse_args()
    stale = []
    for name, text in render().items():
        for folder in (OUT, CHART_COPY):
            path = folder / name
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
                if not args.check:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text)
    if args.check and stale:
        print("stale: " + ", ".join(stale) + " (run python scripts/gen_dashboards.py)")
        return 1
    for s in [] if args.check else stale:
        print(f"wrote {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
