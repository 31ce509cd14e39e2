"""Xids from NVML's event API reach /metrics and /events without any kernel log."""

from __future__ import annotations

import json
import re
import time

from tests.conftest import FIXTURES

CAPTURE = FIXTURES / "nvml" / "h200x2-record.json"


def test_nvml_xid_event_without_kernel_log(start_daemon, tmp_path) -> None:
    capture = json.loads(CAPTURE.read_text())
    capture["script"] = [{"device": 1, "from_poll": 2, "xid": 79}]
    path = tmp_path / "xid79.json"
    path.write_text(json.dumps(capture))
    cfg = (
        "sources:\n  nvml:\n    interval: 0.5\n  kmsg:\n    enabled: false\n"
        "  udev:\n    enabled: false\n  shm:\n    enabled: false\n"
        "  infiniband:\n    enabled: false\n"
    )
    d = start_daemon(cfg, "--nvml-replay", str(path))
    found = ""
    end = time.monotonic() + 20
    while time.monotonic() < end and not found:
        text = d.get("/metrics")[1].decode()
        m = re.search(r'gpuwatchd_xid_active\{[^}]*gpu="1"[^}]*xid="79"[^}]*\} 1\.0', text)
        found = m.group(0) if m else ""
        time.sleep(0.1)
    assert found, d.output()
    assert 'severity="critical"' in found  # Xid 79 (fallen off the bus) pages by default
    events = json.loads(d.get("/events")[1])["events"]
    assert [(e["kind"], e["code"]) for e in events] == [("xid", 79)]
