"""Typed contracts in model.py: Xid fields on the event, the GPU inventory, one Clear."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import load
from gpuwatchd.model import Clear, Event, Gpu, GpuInventory, Severity, XidFields
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
    assert xid109 is not None and xid109.pid == 1797828 and xid109.process == "pt_main_thread"


def test_xid_fields_read_bad_numbers_as_absent_and_other_kinds_have_none() -> None:
    ev = Event(
        "xid",
        "nvml",
        1.0,
        code=154,
        severity=Severity.CRITICAL,
        attrs=(("pid", "not-a-pid"), ("recovery_action", "GPU Reset Required"), ("fatal", "x")),
    )
    assert ev.xid == XidFields(code=154, recovery_action="GPU Reset Required")
    assert Event("gpu_lost", "nvml", 1.0).xid is None


def test_one_clear_type_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        Clear(1.0, "alice")  # type: ignore[misc]
    c = Clear(time=1.0, who="alice", pci_bus_id="0000:06:00.0", code=79)
    assert (c.kind, c.reset, c.id) == ("xid", False, 0)
