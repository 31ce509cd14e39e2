"""A full 8-GPU HGX node built from the real captures: every GPU's 18 NVLinks
with error counters, and 8 ConnectX InfiniBand ports.

The recorded H200 captures hold all 18 links' states but link 0's error
counters only (the probe asked for link 0). `hgx_capture()` gives every link
of every GPU link 0's recorded answers, which is what a healthy HGX board
returns. `hgx_sysfs()` copies the recorded ConnectX device (mlx5_0, one port)
to mlx5_0..mlx5_7, each with its own PCI function.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

from gpuwatchd.sources.nvml.read import NVLINK_ERROR_FIELDS

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x8-from-h200x2.json"
SYSFS = ROOT / "tests" / "fixtures" / "sys"
LINKS = 18
ERROR_COUNTERS = 5
IB_PORTS = 8

__all__ = ["IB_PORTS", "LINKS", "hgx_capture", "hgx_sysfs", "write_hgx"]


def hgx_capture(base: Path = CAPTURE) -> dict[str, Any]:
    """The 8-GPU capture with error counters recorded for all 18 links of each GPU."""
    cap: dict[str, Any] = json.loads(base.read_text())
    for dev in cap["devices"]:
        calls = dev["calls"]
        for link in range(LINKS):
            calls.setdefault(f"nvlink_state({link})", copy.deepcopy(calls["nvlink_state(0)"]))
            for counter in range(ERROR_COUNTERS):
                key = f"nvlink_error_counter({link},{counter})"
                calls.setdefault(key, copy.deepcopy(calls[f"nvlink_error_counter(0,{counter})"]))
            fields = dev["fields"]
            for name in NVLINK_ERROR_FIELDS:
                if f"{name}@0" in fields:
                    fields.setdefault(f"{name}@{link}", copy.deepcopy(fields[f"{name}@0"]))
    cap["note"] = (
        f"{cap.get('note', '')} Widened by benchmarks/hgx.py: link 0's error counters"
        " copied to links 1-17."
    ).strip()
    return cap


def hgx_sysfs(dest: Path, ports: int = IB_PORTS) -> Path:
    """A sysfs root with `ports` ConnectX devices (copies of the recorded mlx5_0)."""
    ib = dest / "class" / "infiniband"
    ib.mkdir(parents=True, exist_ok=True)
    src = (SYSFS / "class" / "infiniband" / "mlx5_0").resolve()
    for i in range(ports):
        target = ib / f"mlx5_{i}"
        if target.exists():
            continue
        shutil.copytree(src, target, symlinks=False, ignore=shutil.ignore_patterns("device"))
        pci = dest / "devices" / f"0000:{0x1A + i:02x}:00.0"
        pci.mkdir(parents=True, exist_ok=True)
        (target / "device").symlink_to(pci)
    return dest


def write_hgx(dest: Path) -> tuple[Path, Path]:
    """Write the capture and the sysfs root under `dest`; returns both paths."""
    dest.mkdir(parents=True, exist_ok=True)
    capture = dest / "h200x8-hgx.json"
    capture.write_text(json.dumps(hgx_capture()))
    return capture, hgx_sysfs(dest / "sys")
