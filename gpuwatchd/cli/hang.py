"""`gpuwatchd hang show [ID]`: the job hangs the daemon recorded, with stacks and RAS.

Reads the daemon's event store (daemon.state_dir): every `job_hang` event
carries a typed `HangReport` (ranks, where each is stuck, signature and
remediation, py-spy dumps, NCCL RAS answer), read back from its stored row.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.command import add_state_dir
from gpuwatchd.model import HANG_KIND, HangReport
from gpuwatchd.sinks.store import EventStore

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["hang_reports", "register", "render"]


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


def hang_reports(store: EventStore, limit: int = 20) -> list[tuple[int, HangReport]]:
    """(event id, report) of the newest `job_hang` events, newest first."""
    out = []
    for row in store.recent(limit, kind=HANG_KIND):
        report = HangReport.from_attrs(row.get("attrs") or {})
        if report is not None:
            out.append((int(row.get("id") or 0), report))
    return out


def _when(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def render(doc: HangReport, event_id: int, full: bool) -> str:
    """Text for one hang: the headline, and with `full` the ranks, stacks and RAS answer."""
    state = "resolved " + _when(doc.resolved_at) if doc.resolved_at else "OPEN"
    lines = [
        f"hang {doc.id} (event {event_id}) job {doc.job}: since {_when(doc.since)}, {state}",
        f"  {doc.reason}",
        f"  signature: {doc.signature or 'none yet'}   signals: {doc.signals}"
        + (f"   severity: {doc.severity}" if doc.severity else ""),
    ]
    inc = doc.causes
    if doc.cause:
        label = f" (incident {doc.incident})" if doc.incident else ""
        lines.append(f"  cause: {doc.cause}{label}")
    for alt in inc.alternatives if inc is not None else ():
        lines.append(f"  alternative: {alt.text}")
    if not full:
        return "\n".join(lines)
    lines.append(f"  where: {doc.where}")
    if inc is not None and inc.cause is not None and inc.cause.evidence:
        lines.append(f"  cause evidence: {inc.cause.evidence}")
    if doc.diverging_frame:
        lines.append(f"  first diverging frame: {doc.diverging_frame}")
    lines += [f"  missing: {m}" for m in doc.missing]
    if doc.stacks_confirmed:
        lines.append("  stacks: every rank in the same call in two dumps seconds apart")
    lines += [f"  flight recorder: {g}" for g in doc.flight_recorder]
    lines += [f"  flight recorder: {e}" for e in doc.flight_recorder_errors]
    for r in doc.ranks:
        counts = ", ".join(f"{k} {v}" for k, v in r.collective_counts)
        lines.append(
            f"  rank {r.rank} pid {r.pid} gpus {','.join(r.gpus)}:"
            f" {r.where or r.state}" + (f" [{counts}]" if counts else "")
        )
        if r.stack_error:
            lines.append(f"    no stack: {r.stack_error}")
    if doc.remediation:
        lines += ["", "remediation:", f"  {doc.remediation}"]
    for st in doc.stacks:
        lines += ["", f"--- stack of pid {st.pid} ---", st.dump or st.error]
    if doc.ras_answer or doc.ras_error:
        lines += ["", "--- NCCL RAS ---", doc.ras_answer or f"error: {doc.ras_error}"]
    return "\n".join(lines)


def _run_show(ctx: CommandContext) -> int:
    args: Any = ctx.args
    if not ctx.has_store():
        print(f"no event store in {ctx.state_dir}", file=sys.stderr)
        return 1
    found = hang_reports(ctx.store(), max(args.limit, 1) if args.id is None else 1000)
    if args.id is not None:
        found = [(e, r) for e, r in found if args.id in (r.id, e)][:1]
        if not found:
            print(f"no hang {args.id}", file=sys.stderr)
            return 1
    docs = [{**r.json(), "event_id": e} for e, r in found]
    if args.json:
        print(json.dumps(docs if args.id is None else docs[0], indent=1))
    elif not found:
        print("no job hang recorded")
    else:
        print("\n\n".join(render(r, e, full=args.id is not None) for e, r in found))
    return 0
