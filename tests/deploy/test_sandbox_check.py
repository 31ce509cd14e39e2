"""deploy/systemd/sandbox_check.py: the unit's seccomp settings, reproduced and applied.

On a GPU node the check compares real NVML calls (see docs/deploy.md for the
H200 result); here it runs on a replayed capture, and a probe shows that the
filters it installs really refuse what the unit refuses.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT

SCRIPT = ROOT / "deploy" / "systemd" / "sandbox_check.py"
pytestmark = [
    pytest.mark.skipif(ctypes.util.find_library("seccomp") is None, reason="no libseccomp"),
    pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze"),
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

PROBE = """
import mmap, os, sys
sys.path.insert(0, {script_dir!r})
import sandbox_check as s
s.install(s.allowed_syscalls())
out = []
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    out.append("wx-allowed")
except PermissionError:
    out.append("wx-denied")
try:
    os.setpriority(os.PRIO_PROCESS, 0, 1)
    out.append("setpriority-allowed")
except PermissionError:
    out.append("setpriority-denied")
mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
print(" ".join(out))
"""


def test_filters_refuse_what_the_unit_refuses() -> None:
    res = subprocess.run(
        [sys.executable, "-c", PROBE.format(script_dir=str(SCRIPT.parent))],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # MemoryDenyWriteExecute=yes and ~@resources (setpriority) both bite
    assert res.stdout.split() == ["wx-denied", "setpriority-denied"]


def test_allow_list_matches_the_unit() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import sandbox_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    unit = (ROOT / "deploy" / "systemd" / "gpuwatchd.service").read_text()
    assert "SystemCallFilter=@system-service\n" in unit
    assert "SystemCallFilter=~@privileged @resources\n" in unit
    assert "MemoryDenyWriteExecute=yes\n" in unit
    allowed = sandbox_check.allowed_syscalls()
    assert {"ioctl", "openat", "mmap", "read"} <= allowed
    assert not {"setpriority", "sched_setaffinity", "setuid", "mount"} & allowed


def test_replayed_capture_passes(tmp_path: Path) -> None:
    capture = FIXTURES / "nvml" / "h200x2-probe.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-replay", str(capture)],
        capture_output=True, text=True, timeout=120, check=False, env=ENV, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 differ" in res.stdout
