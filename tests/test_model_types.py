"""Typed contracts in the model: Xid fields on the event, the GPU inventory, one Clear."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import load
from gpuwatchd.model import (
    Clear,
    Event,
    Gpu,
    GpuInventory,
    ProcessKill,
    Severity,
    XidAttribution,
    XidFields,
)
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource

FIXTURE = Path(__file__).parent / "fixtures" / "kmsg" / "dmesg-T-xid13-xid109.txt"


def test_xid_fields_of_a_real_xid13_report(tmp_path: Path) -> None:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(f"sources:\n  kmsg:\n    backend: file\n    file: {FIXTURE}\n")
    gpus = GpuInventory((Gpu(index=3, uuid="GPU-x", pci_bus_id="0000:cb:00.0"),))
    src = KmsgSource(
        load(str(cfg_file)), SourceContext(clock=FakeClock(), gpus=lambda: gpus), wait=0.05
    )
    try:
        events = [e for e in src.poll(0.0) if isinstance(e, Event)]
    finally:
        src.close()
    xid13 = next(e.xid for e in events if e.code == 13 and e.xid and e.xid.gpc is not None)
    assert xid13 is not None and xid13.code == 13
    assert (xid13.gpu, xid13.uuid) == ("3", "GPU-x")  # from the inventory, typed
    assert (xid13.gpc, xid13.tpc, xid13.sm) == (7, 7, 0)  # "(GPC 7, TPC 7, SM 0)"
    xid109 = next(e.xid for e in events if e.code == 109)
    assert xid109 is not None and xid109.attribution.pid == 1797828
    assert xid109.attribution.process == "pt_main_thread"


def test_xid_fields_keep_bad_numbers_as_text_and_other_kinds_have_none() -> None:
    attrs = (("fatal", "x"), ("pid", "07"), ("recovery_action", "GPU Reset Required"))
    ev = Event("xid", "nvml", 1.0, code=154, severity=Severity.CRITICAL, attrs=attrs)
    # typed only where the text reads back exactly; the rest is kept as written
    want = XidFields(code=154, recovery_action="GPU Reset Required", facts=attrs[:2])
    assert ev.xid == want and ev.attrs == attrs
    assert Event("gpu_lost", "nvml", 1.0).xid is None


def test_an_event_carries_one_payload_and_attrs_is_its_view() -> None:
    who = XidAttribution(pid=650, process="python3", verified="slurm", job=(("slurm_job", "7"),))
    fields = XidFields(code=31, gpu="0", attribution=who, name="MMU Fault", pids=(650, 651))
    ev = Event("xid", "kmsg", 1.0, code=31, payload=fields, attrs=(("stale", "ignored"),))
    assert ev.attrs == (
        ("attribution", "slurm"),
        ("gpu", "0"),
        ("name", "MMU Fault"),
        ("pid", "650"),
        ("pids", "650,651"),
        ("process", "python3"),
        ("slurm_job", "7"),
    )
    assert XidFields.from_attrs(31, ev.attrs) == fields
    assert dataclasses.replace(ev, payload=dataclasses.replace(fields, gpu="1")).attr("gpu") == "1"
    with pytest.raises(TypeError):
        Event("sxid", "kmsg", 1.0, payload=ProcessKill(kind="oom_kill", pid=1))


def test_a_payload_events_view_is_derived_when_read_and_carrying_is_replace() -> None:
    """The Xid stage's steps make a new event per payload (`carrying`) without deriving
    its attrs; the view read later, compared, hashed or pickled is the payload's."""
    fields = XidFields(code=13, gpu="2", gpc=1, attribution=XidAttribution(pid=77))
    ev = Event("xid", "kmsg", 5.0, code=13, message="a", payload=XidFields(code=13))
    moved = ev.carrying(fields, message="a | b", severity=Severity.CRITICAL)
    same = dataclasses.replace(ev, payload=fields, message="a | b", severity=Severity.CRITICAL)
    assert moved == same and hash(moved) == hash(same)
    assert moved.attrs == fields.attrs() == same.attrs
    assert moved.carrying(fields) == moved and ev.carrying(fields).message == "a"
    assert pickle.loads(pickle.dumps(moved)) == moved
    assert dataclasses.replace(moved, pci_bus_id="0000:3b:00.0").attr("gpc") == "1"
    assert Event("gpu_lost", "nvml", 1.0, attrs=(("why", "x"),)).attrs == (("why", "x"),)
    changes = {"gpu": "1", "pids": (3, 4), "name": "Graphics Engine Exception"}
    assert fields.changed(**changes) == dataclasses.replace(fields, **changes)  # type: ignore[arg-type]


def test_one_clear_type_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        Clear(1.0, "alice")  # type: ignore[misc]
    c = Clear(time=1.0, who="alice", pci_bus_id="0000:06:00.0", code=79)
    assert (c.kind, c.reset, c.id) == ("xid", False, 0)
