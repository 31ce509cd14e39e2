"""`gpuwatchd evidence list | show ID`: the evidence bundles under the state directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.command import add_state_dir
from gpuwatchd.logs import escape_control

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["register", "render_bundle"]


def register(subparsers: Any) -> None:
    """Add the `evidence` subcommand with its `list` and `show ID` actions."""
    p = subparsers.add_parser(
        "evidence",
        help="list or show the evidence bundles written before remediation",
        description="Bundles written when a critical condition was raised or before a "
        "remediation acted (kernel log, NVML, stored events, the incident's detail).",
    )
    actions = p.add_subparsers(metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="the bundles, newest first")
    show = actions.add_parser("show", help="one bundle's files")
    show.add_argument("id", help="the bundle's id (the first column of `evidence list`)")
    for q in (p, listing, show):
        # the same options before or after the action (`evidence --json list` too)
        after = q is not p
        q.add_argument(
            "--config",
            metavar="FILE",
            default=argparse.SUPPRESS if after else None,
            help="YAML config (default: built-in defaults)",
        )
        add_state_dir(q, "where the bundles are (<state dir>/evidence)", after=after)
        q.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS if after else False,
            help="print JSON (the machine form)",
        )
    listing.set_defaults(func=_run_list)
    show.set_defaults(func=_run_show)


def _run_list(ctx: CommandContext) -> int:
    from gpuwatchd.sinks.evidence import list_bundles

    args: Any = ctx.args
    cfg = ctx.config
    bundles = list_bundles(cfg)
    if args.json:
        print(json.dumps(bundles, indent=1))
        return 0
    for m in bundles:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(m.get("time", 0))))
        size = sum(int(v) for v in (m.get("files") or {}).values())
        print(f"{m['id']}  {when}  {m.get('why', '')}: {m.get('incident', '')}  ({size} bytes)")
    if not bundles:
        print(f"no evidence bundles in {cfg.daemon.state_dir}")
    return 0


def _run_show(ctx: CommandContext) -> int:
    from gpuwatchd.sinks.evidence import EVIDENCE_DIR, read_bundle

    args: Any = ctx.args
    cfg = ctx.config
    doc = read_bundle(cfg, args.id)
    if doc is None:
        print(
            f"gpuwatchd evidence: no bundle {args.id!r} in {cfg.daemon.state_dir}", file=sys.stderr
        )
        return 1
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        sys.stdout.write(render_bundle(doc, os.path.join(cfg.daemon.state_dir, EVIDENCE_DIR)))
    return 0


def render_bundle(doc: Mapping[str, Any], root: str) -> str:
    """A bundle for a terminal: its metadata, then each file as the text it holds (a
    binary one by its path under `root`)."""
    meta = doc.get("meta") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(meta.get("time", 0))))
    out = [
        f"bundle {meta.get('id', '')}  {when}  {meta.get('why', '')}: {meta.get('incident', '')}"
    ]
    for name, size in (meta.get("files") or {}).items():
        where = os.path.join(root, str(meta.get("id", "")), name)
        out.append(f"  {name}  {size} bytes" + ("" if name in doc else f" (not text: {where})"))
    for name, text in doc.items():
        if name != "meta" and isinstance(text, str):
            # kernel log text can hold escape sequences: never hand them to the terminal
            out += ["", f"--- {name} ---", *(escape_control(ln) for ln in text.splitlines())]
    return "\n".join(out) + "\n"
