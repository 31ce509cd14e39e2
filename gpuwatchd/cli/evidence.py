"""`gpuwatchd evidence list | show ID`: the evidence bundles under the state directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from gpuwatchd import config

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the `evidence` subcommand."""
    p = subparsers.add_parser(
        "evidence",
        help="list or show the evidence bundles written before remediation",
        description="Bundles written when a critical condition was raised or before a "
        "remediation acted (kernel log, NVML, stored events, the incident's detail).",
    )
    p.add_argument("what", choices=("list", "show"))
    p.add_argument("id", nargs="?", default="", help="the bundle (show)")
    p.add_argument("--config", metavar="FILE", help="YAML config (default: built-in defaults)")
    p.add_argument("--state-dir", metavar="DIR", help="override daemon.state_dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gpuwatchd.sinks.evidence import list_bundles, read_bundle

    cfg = config.load(args.config)
    if args.state_dir:
        cfg = dataclasses.replace(
            cfg, daemon=dataclasses.replace(cfg.daemon, state_dir=args.state_dir)
        )
    if args.what == "show":
        doc = read_bundle(cfg, args.id)
        if doc is None:
            print(f"gpuwatchd evidence: no bundle {args.id!r}", file=sys.stderr)
            return 1
        print(json.dumps(doc, indent=1))
        return 0
    bundles = list_bundles(cfg)
    if args.json:
        print(json.dumps(bundles, indent=1))
        return 0
    for m in bundles:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(m.get("time", 0))))
        size = sum(int(v) for v in (m.get("files") or {}).values())
        print(f"{m['id']}  {when}  {m.get('why', '')}: {m.get('incident', '')}  ({size} bytes)")
    if not bundles:
        print("no evidence bundles")
    return 0
