"""`gpuwatchd hang show [ID]`: the job hangs the daemon recorded, with stacks and RAS.

Reads the daemon's event store (daemon.state_dir): every `job_hang` event
carries the forensics document (ranks, where each is stuck, signature and
remediation, py-spy dumps, NCCL RAS answer).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.command import add_state_dir
from gpuwatchd.sinks.store import EventStore

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["hang_documents", "register", "render"]


def register(subparsers: Any) -> None:
    """Add the `hang` subcommand."""
    p = subparsers.add_parser(
        "hang",
        help="show the job hangs the daemon suspected (stacks, NCCL RAS, signature)",
        description="List suspected job hangs, or show one with every rank's stack and the"
        " NCCL RAS answer.",
    )
    sub = p.add_subparsers(metavar="ACTION")
    show = sub.add_parser("show", help="list hangs, or show one by ID")
    show.add_argument("id", nargs="?", type=int, help="the hang's id (from the list)")
    show.add_argument("--config", help="config file (default: built-in defaults)")
    add_state_dir(show, "the daemon's event store")
    show.add_argument("--json", action="store_true", help="print the documents as JSON")
    show.add_argument("--limit", type=int, default=20, help="newest N hangs (default 20)")
    show.set_defaults(func=_run_show)


def hang_documents(store: EventStore, limit: int = 20) -> list[dict[str, Any]]:
    """The forensics documents of the newest `job_hang` events, newest first."""
    out = []
    for row in store.recent(limit, kind="job_hang"):
        attrs = row.get("attrs") or {}
        try:
            doc = json.loads(attrs.get("forensics", "{}"))
        except ValueError:
            continue
        if isinstance(doc, dict):
            doc["event_id"] = row.get("id")
            out.append(doc)
    return out


def _when(t: Any) -> str:
    if not isinstance(t, int | float) or not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def render(doc: Mapping[str, Any], full: bool) -> str:
    """Text for one hang: the headline, and with `full` the ranks, stacks and RAS answer."""
    state = "resolved " + _when(doc.get("resolved_at")) if doc.get("resolved_at") else "OPEN"
    lines = [
        f"hang {doc.get('id')} (event {doc.get('event_id')}) job {doc.get('job')}: "
        f"since {_when(doc.get('since'))}, {state}",
        f"  {doc.get('reason', '')}",
        f"  signature: {doc.get('signature') or 'none yet'}   signals: {doc.get('signals', '')}"
        + (f"   severity: {doc['severity']}" if doc.get("severity") else ""),
    ]
    inc = doc.get("causes") or {}
    if doc.get("cause"):
        label = f" (incident {doc['incident']})" if doc.get("incident") else ""
        lines.append(f"  cause: {doc['cause']}{label}")
    for alt in inc.get("alternatives") or ():
        lines.append(f"  alternative: {alt.get('text', '')}")
    if not full:
        return "\n".join(lines)
    lines.append(f"  where: {doc.get('where', '')}")
    if (inc.get("cause") or {}).get("evidence"):
        lines.append(f"  cause evidence: {inc['cause']['evidence']}")
    if doc.get("diverging_frame"):
        lines.append(f"  first diverging frame: {doc['diverging_frame']}")
    for m in doc.get("missing") or ():
        lines.append(f"  missing: {m}")
    if doc.get("stacks_confirmed"):
        lines.append("  stacks: every rank in the same call in two dumps seconds apart")
    for g in doc.get("flight_recorder") or ():
        lines.append(f"  flight recorder: {g}")
    for e in doc.get("flight_recorder_errors") or ():
        lines.append(f"  flight recorder: {e}")
    for r in doc.get("ranks") or ():
        counts = ", ".join(f"{k} {v}" for k, v in (r.get("collective_counts") or {}).items())
        lines.append(
            f"  rank {r.get('rank')} pid {r.get('pid')} gpus {','.join(r.get('gpus') or [])}:"
            f" {r.get('where') or r.get('state')}" + (f" [{counts}]" if counts else "")
        )
        if r.get("stack_error"):
            lines.append(f"    no stack: {r['stack_error']}")
    if doc.get("remediation"):
        lines += ["", "remediation:", f"  {doc['remediation']}"]
    for pid, st in (doc.get("stacks") or {}).items():
        lines += ["", f"--- stack of pid {pid} ---", st.get("dump") or st.get("error", "")]
    ras = doc.get("ras") or {}
    if ras.get("answer") or ras.get("error"):
        lines += ["", "--- NCCL RAS ---", ras.get("answer") or f"error: {ras.get('error')}"]
    return "\n".join(lines)


def _run_show(ctx: CommandContext) -> int:
    args: Any = ctx.args
    if not ctx.has_store():
        print(f"no event store in {ctx.state_dir}", file=sys.stderr)
        return 1
    docs = hang_documents(ctx.store(), max(args.limit, 1) if args.id is None else 1000)
    if args.id is not None:
        docs = [d for d in docs if d.get("id") == args.id or d.get("event_id") == args.id][:1]
        if not docs:
            print(f"no hang {args.id}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(docs if args.id is None else docs[0], indent=1))
    elif not docs:
        print("no job hang recorded")
    else:
        print("\n\n".join(render(d, full=args.id is not None) for d in docs))
    return 0
