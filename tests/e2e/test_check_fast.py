"""Drill: `gpuwatchd check` answers at once on a healthy node (issue 20).

The kernel log reader waited up to 10 s for records that were not coming
(`BLOCKING_WAIT`) and `check` always made one last read that found
nothing: a healthy node took 10.3 s, and with `--timeout` below that it
was UNKNOWN (`--format npd`: "cannot read: kmsg"). Here the real CLI runs
on the NVML replay with the kernel log on a FIFO that, like /dev/kmsg,
never ends (a writer holds it open), and on a plain file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-probe.json"
NO_XID = ROOT / "tests" / "fixtures" / "kmsg" / "talos-kern-nvrm-no-xid.txt"
BOOT = "0f3c1f7e-8a2b-4c6d-9e10-1234567890ab"
RECORDS = (
    b"6,1012,4875130,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07\n"
    b"6,1013,4875222,-;nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver\n"
)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    """A node's roots; `kmsg` is a FIFO with records in it and a writer attached."""
    for d in ("shm", "sys"):
        (tmp_path / d).mkdir()
    (tmp_path / "boot_id").write_text(BOOT + "\n")
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    os.write(writer, RECORDS)
    try:
        yield tmp_path
    finally:
        os.close(writer)


def _config(node: Path, kmsg: str) -> Path:
    path = node / f"config-{kmsg.split(',')[0].split(':')[-1].strip()}.yaml"
    path.write_text(
        f"daemon: {{state_dir: {node / 'state'}, node_name: gpu-node-17}}\n"
        f"paths: {{dev_shm: {node / 'shm'}, sysfs: {node / 'sys'}, boot_id: {node / 'boot_id'},"
        f" kmsg: {node / 'kmsg'}}}\n"
        "sources:\n"
        f"  nvml: {{replay: {H200}}}\n"
        f"  kmsg: {{{kmsg}}}\n"
    )
    return path


def _check(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check", "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    "kmsg", ["backend: kmsg", f"backend: file, file: {NO_XID}"], ids=["dev-kmsg", "file"]
)
def test_check_on_a_healthy_node_is_ok_within_two_seconds(node: Path, kmsg: str) -> None:
    cfg = _config(node, kmsg)
    got = _check(cfg, "--timeout", "2")
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.startswith("gpuwatchd check: OK - 0 critical, 0 warning"), got.stdout
    assert "kmsg ok" in got.stdout
    npd = _check(cfg, "--timeout", "2", "--format", "npd")
    assert (npd.returncode, npd.stdout) == (0, "healthy: 2 GPU(s)\n"), npd.stderr
