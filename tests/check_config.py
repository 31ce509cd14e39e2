"""A config for `gpuwatchd check` and the daemon over files: a recorded NVML capture, a
kernel log file, an empty /dev/shm and sysfs, a fixed boot id (the tests that run the
whole chain on one node's files)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-probe.json"
BOOT_ID = "0f3c1f7e-8a2b-4c6d-9e10-1234567890ab"


def write_check_config(
    tmp: Path, kmsg_file: Path, node: str = "gpu-node-17", extra: str = ""
) -> Path:
    """TMP/config.yaml over TMP's shm, sys, boot_id and state; `extra` YAML appended."""
    for d in ("shm", "sys"):
        (tmp / d).mkdir(exist_ok=True)
    (tmp / "boot_id").write_text(BOOT_ID + "\n")
    path = tmp / "config.yaml"
    path.write_text(
        f"daemon: {{state_dir: {tmp / 'state'}, node_name: {node}}}\n"
        f"paths: {{dev_shm: {tmp / 'shm'}, sysfs: {tmp / 'sys'}, boot_id: {tmp / 'boot_id'}}}\n"
        f"sources:\n  nvml: {{replay: {H200}}}\n  kmsg: {{backend: file, file: {kmsg_file}}}\n"
        + extra
    )
    return path
