"""An alert about the daemon's own state dir: writes failing, a corrupt file moved aside,
the directory deleted or replaced. Xids are still tracked and alerted from memory meanwhile,
but a restart would not remember them, so the operator must hear of it."""

from __future__ import annotations

from gpuwatchd.health.rules import Inputs, finding
from gpuwatchd.model import Finding, labels_of

__all__ = ["ALERTNAME", "state_dir"]

# The existing collector alert, for the "event_store" collector: same name and labels
# as the Prometheus rule, so no new route is needed; the description names the state dir.
ALERTNAME = "GpuwatchdCollectorFailed"


def _value(inp: Inputs, name: str) -> float:
    return sum(s.value for s in inp.view.series(name))


def state_dir(inp: Inputs) -> list[Finding]:
    """The event store failing to write, or having lost or quarantined its file."""
    where = inp.cfg.daemon.state_dir
    if not inp.view.series("gpuwatchd_event_store_up"):
        return []  # no store (e.g. `gpuwatchd check`)
    problems = []
    if _value(inp, "gpuwatchd_event_store_up") < 1:
        held = int(_value(inp, "gpuwatchd_event_store_held_events"))
        problems.append(
            f"writes to the event store in {where} fail; {held} event(s) held in memory"
        )
    quarantined = int(_value(inp, "gpuwatchd_event_store_quarantined_total"))
    if quarantined:
        problems.append(f"{quarantined} corrupt event store file(s) in {where} moved aside")
    replaced = [
        s.value for s in inp.view.series("gpuwatchd_event_store_errors_total", op="state_dir")
    ]
    if replaced and replaced[0] > 0:
        problems.append(f"state dir {where} was deleted or replaced while running and re-created")
    if not problems:
        return []
    reason = "; ".join(problems) + " (events still tracked and alerted from memory)"
    subject = labels_of({"collector": "event_store"})
    return [finding(ALERTNAME, subject, reason, "state_dir", scope="component")]
