"""When a quiet node's findings can next change with time alone.

The consumer's 1 s tick used to run every rule every second. On a quiet
node (nothing open, nothing waiting out a `for` window, no new snapshot)
the rules' answer can change by the passing of time only where a rule
compares `now` with a time in the snapshot or the history and a finding
appears once a threshold is crossed:

- a collector failing since `History.fail_since` for
  `health.collector_failure_seconds` (rules.collectors and, for NVML,
  rules.gpu_presence);
- a collector whose last poll is older than
  max(collector_failure_seconds, 3 x its interval, rules.STALE_MIN)
  (rules.collectors).

Everything else a rule reads with `now` only fades with time (counter
rates over the window, "rose within the hold time"), moves with a new
snapshot (the stuck-GPU detector counts NVML poll stamps; Xid expiries
and escalations arrive as Xid stage samples), or belongs to an open or
pending finding, which the engine re-evaluates every tick as before.
`next_change` is the earliest of those thresholds; the engine also
evaluates at least every `MAX_QUIET_SECONDS`, for rules registered from
elsewhere whose time dependence this module does not know.
"""

from __future__ import annotations

from gpuwatchd.config import Config
from gpuwatchd.health.history import History
from gpuwatchd.health.rules import STALE_MIN
from gpuwatchd.state import NodeSnapshot

__all__ = ["MAX_QUIET_SECONDS", "next_change"]

MAX_QUIET_SECONDS = 60.0


def next_change(snapshot: NodeSnapshot, history: History, cfg: Config) -> float:
    """The earliest wall time a time-based finding can appear without new input."""
    h = cfg.health
    due = float("inf")
    for name, snap in snapshot.sources.items():
        since = history.fail_since.get(name)
        if not snap.ok and since is not None:
            due = min(due, since + h.collector_failure_seconds)
        if snap.timestamp:
            section = getattr(cfg.sources, name, None)
            interval = float(getattr(section, "interval", 0.0) or 0.0)
            due = min(
                due, snap.timestamp + max(h.collector_failure_seconds, 3 * interval, STALE_MIN)
            )
    return due
