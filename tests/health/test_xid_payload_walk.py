"""Every captured kernel log, source -> Xid stage -> store -> read back: one typed payload.

The store keeps a report's payload once, as its attrs view; what it reads
back is the payload the stage stored, field for field. What users see of
it (the /events rows, the journal fields, the Xid rule's conditions) is what
the daemon showed before payloads were typed: tests/fixtures/xid-walk.json
was written by the walk (tests/health/xid_walk.py) on the release before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatchd.model import Event, Severity, XidFields
from tests.health.xid_walk import FIXTURES, GOLDEN, walk

FILES = sorted(FIXTURES.glob("*.txt"))


def nvml_event(code: int, bus: str, t: float) -> Event:
    """NVML's Xid event as the NVML source hands it on (events.py, source.py)."""
    fields = XidFields(code=code, gpu="0", uuid="GPU-0", via="nvml_event")
    message = f"Xid {code} reported by NVML's event API"
    return Event("xid", "nvml", t, code, bus, message, Severity.WARNING, payload=fields)


@pytest.mark.parametrize("fixture", FILES, ids=[f.name for f in FILES])
def test_stored_reports_read_back_as_the_payload_the_stage_stored(
    fixture: Path, tmp_path: Path
) -> None:
    w = walk(fixture, tmp_path, nvml_event)
    # the payload of each stored row: the last observation of its report's first time
    # (later repeats bump the row's count, not its fields)
    stored: dict[str, XidFields] = {}
    first: dict[str, float] = {}
    for obs in w.observed:
        assert obs.event.xid is not None
        if first.setdefault(obs.burst_id, obs.event.time) == obs.event.time:
            stored[obs.burst_id] = obs.event.xid
    assert len(w.read_back) == len(stored)
    for ev in w.read_back:
        xid = ev.xid
        assert xid is not None
        assert xid == stored[xid.burst_id], fixture.name
        assert XidFields.from_attrs(ev.code or 0, ev.attrs).attrs() == ev.attrs


def test_what_users_see_is_unchanged(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == [f.name for f in FILES]  # a new capture: regenerate the file
    for i, fixture in enumerate(FILES):
        got = walk(fixture, tmp_path / str(i), nvml_event).seen()
        assert got == golden[fixture.name], fixture.name


def test_the_walk_covers_every_part_of_the_payload(tmp_path: Path) -> None:
    """The captures exercise what each step adds: job, MIG device, NVML, joined lines."""
    seen: set[str] = set()
    for i, fixture in enumerate(FILES):
        for ev in walk(fixture, tmp_path / str(i), nvml_event).read_back:
            seen.update(k for k, _ in ev.attrs)
    want = {"pod_uid", "slurm_job", "rank", "workload", "gpu_instance", "mig_uuid", "pid_start"}
    want |= {"confirmed_by", "lines", "gpc", "fatal", "link", "recovery_action", "epoch"}
    assert want <= seen, want - seen
