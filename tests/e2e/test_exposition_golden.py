"""The whole daemon on a real capture: golden exposition, promtool, hung NVML.

`pytest tests/e2e --update-golden` rewrites tests/fixtures/e2e-output.txt.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, http_get

CAPTURE = FIXTURES / "nvml" / "h200x2-record.json"
H100X2 = FIXTURES / "nvml" / "h100x2-idle-record.json"  # recorded with the topology calls
GOLDEN = FIXTURES / "e2e-output.txt"
# Series whose values depend on the machine or the moment, not on the inputs.
VOLATILE = re.compile(
    r"^(process_\w+|gpuwatchd_(build_info|\w+_duration_seconds|\w+_timestamp_seconds|shm_\w+|"
    r"udev_\w+|kmsg_\w+|memory_\w+))"
)


def config(tmp: Path, **nvml: object) -> str:
    shm = tmp / "shm"
    shm.mkdir(exist_ok=True)
    keys = {"interval": 3600, **nvml}  # each key once: the loader refuses a repeated key
    extra = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in keys.items())
    return (
        f"paths:\n  sysfs: {FIXTURES / 'sys'}\n  dev_shm: {shm}\n"
        "sources:\n"
        "  nvml:\n" + extra + "  kmsg:\n    enabled: false\n"
        "  udev:\n    enabled: false\n"
    )


def stable(exposition: str) -> str:
    """Families sorted by name, samples sorted, volatile samples dropped; HELP/TYPE kept."""
    blocks: dict[str, list[str]] = {}
    name = ""
    for ln in exposition.splitlines():
        if ln.startswith("# HELP "):
            name = ln.split()[2]
            blocks[name] = [ln]
        elif ln.startswith("#"):
            blocks[name].append(ln)
        elif ln and not VOLATILE.match(ln):
            blocks[name].append(ln)
    out: list[str] = []
    for fam in sorted(blocks):
        head = [ln for ln in blocks[fam] if ln.startswith("#")]
        out += head + sorted(ln for ln in blocks[fam] if not ln.startswith("#"))
    return "\n".join(out) + "\n"


def test_golden_exposition(start_daemon, tmp_path, request) -> None:
    d = start_daemon(config(tmp_path), "--nvml-replay", str(CAPTURE))
    status, body = d.get("/metrics")
    assert status == 200
    got = stable(body.decode())
    if request.config.getoption("--update-golden"):
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "exposition changed; rerun with --update-golden if intended"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize("capture", [CAPTURE, H100X2], ids=lambda p: p.stem)
def test_promtool_check_metrics_on_real_capture(start_daemon, tmp_path, capture: Path) -> None:
    d = start_daemon(config(tmp_path), "--nvml-replay", str(capture))
    _, body = d.get("/metrics")
    res = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().strip() == "" and res.stderr.decode().strip() == ""


def test_status_topology_of_the_2x_h100_vm(start_daemon, tmp_path) -> None:
    # NVML hid the NVLink far ends there; nvidia-smi topo -m printed NV18, CPUs 0-31
    d = start_daemon(config(tmp_path), "--nvml-replay", str(H100X2))
    status, body = d.get("/status")
    assert status == 200
    topology = json.loads(body)["sources"]["nvml"]["topology"]
    assert topology["matrix"] == {
        "GPU0": {"GPU0": "X", "GPU1": "NV18"},
        "GPU1": {"GPU1": "X", "GPU0": "NV18"},
    }
    assert [g["cpu_affinity"] for g in topology["gpus"]] == ["0-31", "0-31"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_golden_file_passes_promtool() -> None:
    res = subprocess.run(
        ["promtool", "check", "metrics"], input=GOLDEN.read_bytes(), capture_output=True
    )
    assert res.returncode == 0, res.stderr.decode()


def test_scrape_is_not_blocked_by_a_hung_nvml_call(start_daemon, tmp_path) -> None:
    capture = json.loads(CAPTURE.read_text())
    # From the second poll on, every NVML call on GPU 0 blocks and never returns.
    capture["script"] = [{"device": 0, "call": "*", "from_poll": 2, "hang": True}]
    hung = tmp_path / "hung.json"
    hung.write_text(json.dumps(capture))
    d = start_daemon(config(tmp_path, interval=0.5, call_timeout=2.0), "--nvml-replay", str(hung))

    worst = 0.0
    end = time.monotonic() + 30
    state_text = ""
    while time.monotonic() < end:
        t0 = time.monotonic()
        status, body = http_get(d.url + "/metrics", timeout=10)
        worst = max(worst, time.monotonic() - t0)
        assert status == 200
        text = body.decode()
        m = re.search(r'gpuwatchd_gpu_nvml_state\{gpu="0"[^}]*\} (\S+)', text)
        if m and float(m.group(1)) == 1.0:
            state_text = text
            break
    assert state_text, "GPU 0 never became unresponsive"
    # The other GPU keeps reporting while GPU 0 hangs.
    assert re.search(r'gpuwatchd_gpu_nvml_state\{gpu="1"[^}]*\} 0\.0', state_text)
    # Keep scraping while the call stays hung: every scrape answers well inside the deadline.
    for _ in range(50):
        t0 = time.monotonic()
        assert http_get(d.url + "/metrics", timeout=10)[0] == 200
        worst = max(worst, time.monotonic() - t0)
    assert worst < 1.0, f"a scrape took {worst:.3f}s while NVML was hung"
    assert http_get(d.url + "/healthz")[0] == 200


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_on_exposition_from_a_real_h200() -> None:
    # Scraped from `gpuwatchd run` on a real H200 (docs/gpu-testing.md).
    real = FIXTURES / "gpu-runs" / "h200-metrics-2026-11-21.txt"
    res = subprocess.run(
        ["promtool", "check", "metrics"], input=real.read_bytes(), capture_output=True
    )
    assert res.returncode == 0, res.stderr.decode()
    assert b"gpuwatchd_gpu_recovery_action{" in real.read_bytes()
