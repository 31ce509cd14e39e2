"""`gpuwatchd check` and `gpuwatchd clear` over the NVML replay of a real H200 capture
and real kernel log lines (file backend), through the CLI entry points."""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import check as checkcmd
from gpuwatchd.cli import clear as clearcmd
from gpuwatchd.cli import dispatch
from gpuwatchd.sources import SourceSpec, registry

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
H200 = FIX / "nvml" / "h200x2-probe.json"
NO_XID = FIX / "kmsg" / "talos-kern-nvrm-no-xid.txt"
XID31 = FIX / "kmsg" / "h200-xid31-kmsg.txt"  # a real Xid 31 from the captured H200
XID109 = FIX / "kmsg" / "dmesg-T-xid13-xid109.txt"  # Xid 13 x3, then 109, dated 2024


@pytest.fixture(autouse=True)
def kmsg_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel log source, in case the registry does not list it (yet)."""
    from gpuwatchd.sources.kmsg import source as kmsg

    if "kmsg" not in registry():
        monkeypatch.setitem(
            registry(), "kmsg", SourceSpec(kmsg.KmsgSource.from_config, True, kmsg.METRICS)
        )


def run(argv: list[str]) -> int:
    """Parse with a parser that has only our subcommands, then run the handler."""
    parser = argparse.ArgumentParser(prog="gpuwatchd")
    sub = parser.add_subparsers()
    checkcmd.register(sub)
    clearcmd.register(sub)
    args = parser.parse_args(argv)
    rc: int = dispatch(args)
    return rc


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    shm = tmp_path / "shm"
    shm.mkdir()
    sysfs = tmp_path / "sys"  # no class/infiniband: a node without InfiniBand
    sysfs.mkdir()
    boot = tmp_path / "boot_id"
    boot.write_text("0f3c1f7e-8a2b-4c6d-9e10-1234567890ab\n")

    def write(kmsg: Path, extra: str = "", nvml: Path = H200) -> Path:
        path = tmp_path / "config.yaml"
        path.write_text(
            f"daemon: {{state_dir: {tmp_path / 'state'}, node_name: gpu-node-17}}\n"
            f"paths: {{dev_shm: {shm}, sysfs: {sysfs}, boot_id: {boot}}}\n"
            "sources:\n"
            f"  nvml: {{replay: {nvml}}}\n"
            f"  kmsg: {{backend: file, file: {kmsg}}}\n" + extra
        )
        return path

    return write


CRITICAL_31 = "xid:\n  overrides:\n    '31': {severity: critical, action: reset_gpu}\n"


def test_healthy_node_is_ok(write_config, capsys) -> None:
    assert run(["check", "--config", str(write_config(NO_XID))]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "gpuwatchd check: OK - 0 critical, 0 warning (node gpu-node-17, 2 GPU(s))"
    )
    assert "nvml ok" in out and "kmsg ok" in out


def test_application_xid_is_a_warning(write_config, capsys) -> None:
    assert run(["check", "--config", str(write_config(XID31))]) == 1
    out = capsys.readouterr().out
    assert "WARNING  GpuXidWarning  GPU 0 (0000:00:06.0)" in out
    assert "compute-sanitizer" in out  # the catalog's remediation, shown as what to do


def test_xid31_configured_critical_is_critical(write_config, capsys) -> None:
    cfg = write_config(XID31, CRITICAL_31)
    assert run(["check", "--config", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("gpuwatchd check: CRITICAL - 1 critical")
    assert "CRITICAL GpuXidCritical  GPU 0 (0000:00:06.0)" in out
    assert "action: reset_gpu" in out and "runbook: docs/runbooks/GpuXidCritical.md" in out

    assert run(["check", "--json", "--config", str(cfg)]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "CRITICAL" and data["exit_code"] == 2
    [cond] = data["conditions"]
    assert cond["alertname"] == "GpuXidCritical" and cond["labels"] == {
        "xid": "31",
        "name": "GPU memory page fault",
        "process": "pid 650 python3",
        "incident": "xid-0000:00:06.0-31",
    }
    assert cond["subject"]["uuid"] == "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"

    assert run(["check", "--format", "npd", "--config", str(cfg)]) == 1
    line = capsys.readouterr().out
    assert line == "GpuXidCritical: Critical Xid 31 on GPU 0\n"


def test_npd_ok_and_warning_threshold(write_config, capsys) -> None:
    assert run(["check", "--format", "npd", "--config", str(write_config(XID31))]) == 0
    assert capsys.readouterr().out == "healthy: 2 GPU(s)\n"
    assert (
        run(
            [
                "check",
                "--format",
                "npd",
                "--npd-problem",
                "warning",
                "--config",
                str(write_config(XID31)),
            ]
        )
        == 1
    )
    assert capsys.readouterr().out.startswith("GpuXidWarning: Xid 31 on GPU 0")


def test_unreadable_source_is_unknown(write_config, tmp_path, capsys) -> None:
    cfg = write_config(tmp_path / "no-such-kernel-log")
    assert run(["check", "--config", str(cfg)]) == 3
    assert "kmsg cannot read" in capsys.readouterr().out
    assert run(["check", "--format", "npd", "--config", str(cfg)]) == 2
    assert capsys.readouterr().out == "cannot read: kmsg\n"


def _hanging(tmp_path: Path, step: dict[str, object]) -> Path:
    capture = json.loads(H200.read_text())
    capture["script"] = [step]
    path = tmp_path / "hung.json"
    path.write_text(json.dumps(capture))
    return path


def test_hung_gpu_cannot_block_the_check(write_config, tmp_path, capsys) -> None:
    hung = _hanging(tmp_path, {"device": 1, "call": "temperature*", "hang": True})
    started = time.monotonic()
    rc = run(["check", "--timeout", "20", "--config", str(write_config(NO_XID, nvml=hung))])
    out = capsys.readouterr().out
    assert time.monotonic() - started < 15, out  # the NVML call deadline (5 s), not more
    assert rc == 2, out
    # The call hung while reading the GPU's identity: known by its index only.
    assert "CRITICAL NvmlUnresponsive  GPU 1\n" in out


def test_hung_nvml_init_is_bounded_by_the_deadline(write_config, tmp_path, capsys) -> None:
    hung = _hanging(tmp_path, {"call": "init", "hang": True})
    started = time.monotonic()
    extra = "health: {expected_gpus: 2}\n"
    rc = run(["check", "--timeout", "3", "--config", str(write_config(NO_XID, extra, nvml=hung))])
    out = capsys.readouterr().out
    assert time.monotonic() - started < 6, out
    assert rc == 2, out  # GPUs expected but NVML does not answer
    assert "NvmlUnresponsive" in out and "nvml no answer within 3s" in out


def test_clear_ends_a_critical_xid_and_records_who(write_config, monkeypatch, capsys) -> None:
    cfg = write_config(XID109)
    assert run(["check", "--config", str(cfg)]) == 2
    out = capsys.readouterr().out
    # 0000:cb:00 is not one of the replayed GPUs: the condition names the bus id.
    assert "CRITICAL GpuXidCritical  pci_bus_id=0000:cb:00.0" in out
    assert run(["check", "--format", "npd", "--config", str(cfg)]) == 1
    assert capsys.readouterr().out == "GpuXidCritical: Critical Xid 109 on GPU 0000:cb:00.0\n"
    monkeypatch.setenv("SUDO_USER", "alice")
    assert (
        run(
            [
                "clear",
                "--gpu",
                "0000:CB:00.0",
                "--reason",
                "GPU reset after Xid 109",
                "--config",
                str(cfg),
                "--new-store",  # no daemon ran here: `check` alone reads the store
            ]
        )
        == 0
    )
    assert "recorded as clear #1 by alice" in capsys.readouterr().out
    state_db = Path(config.load(str(cfg)).daemon.state_dir) / "gpuwatchd.db"
    with sqlite3.connect(state_db) as db:
        rows = db.execute("SELECT who, pci_bus_id, reason, boot_id FROM clears").fetchall()
    assert rows == [
        ("alice", "0000:cb:00.0", "GPU reset after Xid 109", "0f3c1f7e-8a2b-4c6d-9e10-1234567890ab")
    ]
    assert run(["check", "--config", str(cfg)]) == 0, capsys.readouterr().out


def test_clear_resolves_a_gpu_index_through_nvml(write_config) -> None:
    cfg = config.load(str(write_config(NO_XID)))
    assert clearcmd.resolve_gpu(cfg, "1") == "0000:00:07.0"
    assert clearcmd.resolve_gpu(cfg, "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6") == "0000:00:06.0"
    with pytest.raises(Exception, match="no GPU '7'"):
        clearcmd.resolve_gpu(cfg, "7")


def test_check_reads_the_daemons_store_and_never_writes_it(
    write_config, tmp_path: Path, capsys
) -> None:
    """--state-dir: Xids of this boot the daemon stored (gone from the ring buffer since)
    and its GPU count baseline count; the check adds nothing to that store."""
    from gpuwatchd.model import Event, Severity
    from gpuwatchd.sinks.store import EventStore

    daemon_dir = tmp_path / "daemon-state"
    store = EventStore(str(daemon_dir / "gpuwatchd.db"))
    boot = "0f3c1f7e-8a2b-4c6d-9e10-1234567890ab"
    fell_off = Event(
        "xid",
        "kmsg",
        time.time() - 60,
        code=79,
        pci_bus_id="0000:00:07.0",
        severity=Severity.CRITICAL,
        attrs=(("boot_id", boot),),
    )
    store.write([(fell_off, f"{boot}:1", 1)])
    store.save_gpu_baseline(4)
    store.close()
    cfg = write_config(NO_XID)
    assert run(["check", "--config", str(cfg), "--json"]) == 0  # its own state dir: empty
    capsys.readouterr()

    assert run(["check", "--config", str(cfg), "--json", "--state-dir", str(daemon_dir)]) == 2
    report = json.loads(capsys.readouterr().out)
    found = {(c["alertname"], c["subject"].get("pci_bus_id", "")) for c in report["conditions"]}
    assert ("GpuXidCritical", "0000:00:07.0") in found
    assert ("GpuCountLow", "") in {(a, "") for a, _ in found}  # 2 GPUs seen, 4 remembered
    with sqlite3.connect(daemon_dir / "gpuwatchd.db") as db:
        assert db.execute("SELECT count(*) FROM events").fetchone() == (1,)
        assert db.execute("SELECT count(*) FROM cursors").fetchone() == (0,)
        assert db.execute("SELECT value FROM health_memory").fetchall() == [("4",)]


def test_json_names_the_workloads_on_unhealthy_gpus(write_config, tmp_path, capsys) -> None:
    """A Slurm epilog can tell the user their job hit a bad GPU: check --json names it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", TORCHELASTIC_RUN_ID="epilog-test")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # environ set
        capture = json.loads(H200.read_text())
        calls = capture["devices"][0]["calls"]
        calls["compute_running_processes"] = [
            {"value": [{"pid": proc.pid, "used_memory": 1 << 30}], "us": 20.0}
        ]
        nvml = tmp_path / "with-process.json"
        nvml.write_text(json.dumps(capture))
        cfg = write_config(XID31, CRITICAL_31, nvml=nvml)
        assert run(["check", "--json", "--config", str(cfg)]) == 2
        data = json.loads(capsys.readouterr().out)
        assert run(["check", "--config", str(cfg)]) == 2
        out = capsys.readouterr().out
        assert f"On these GPUs: torch job torchelastic:epilog-test [pids {proc.pid}]" in out
    finally:
        proc.kill()
        proc.wait(5)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()
    [held] = data["workloads"]
    assert held["kind"] == "torch" and held["id"] == "torchelastic:epilog-test"
    [p] = held["processes"]
    assert (p["pid"], p["gpu"], p["rank"]) == (proc.pid, "0", "0")
    assert held["run_id"] == "epilog-test"


def test_json_carries_the_gpu_topology(write_config, tmp_path, capsys) -> None:
    capture = json.loads(H200.read_text())
    for i, dev in enumerate(capture["devices"]):
        peer = ("00000000:00:07.0", "00000000:00:06.0")[i]
        for link in range(18):  # as on the machine: all 18 links end at the other GPU
            dev["calls"][f"nvlink_remote_pci_info({link})"] = [{"value": {"busId": peer}}]
        dev["calls"]["cpu_affinity"] = [{"value": [0xFFFFFFFF]}]
    nvml = tmp_path / "with-topology.json"
    nvml.write_text(json.dumps(capture))
    assert run(["check", "--json", "--config", str(write_config(NO_XID, nvml=nvml))]) == 0
    topology = json.loads(capsys.readouterr().out)["topology"]
    assert topology["matrix"] == {
        "GPU0": {"GPU0": "X", "GPU1": "NV18"},
        "GPU1": {"GPU1": "X", "GPU0": "NV18"},
    }
    assert [g["cpu_affinity"] for g in topology["gpus"]] == ["0-31", "0-31"]
    assert [g["nics"] for g in topology["gpus"]] == [[], []]  # this node has no InfiniBand


def test_json_topology_of_a_vm_that_hides_the_nvlink_far_ends(write_config, capsys) -> None:
    # 2x H100 in a VM: NVML answered FFFFFFFF:FF:FF.0 for every link's far end and
    # PHB for the pair; nvidia-smi topo -m printed NV18 (fixtures/nvidia-smi/h100x2-topo-m.txt)
    nvml = FIX / "nvml" / "h100x2-idle-record.json"
    run(["check", "--json", "--config", str(write_config(NO_XID, nvml=nvml))])
    topology = json.loads(capsys.readouterr().out)["topology"]
    assert topology["matrix"] == {
        "GPU0": {"GPU0": "X", "GPU1": "NV18"},
        "GPU1": {"GPU1": "X", "GPU0": "NV18"},
    }
    assert [g["cpu_affinity"] for g in topology["gpus"]] == ["0-31", "0-31"]
    assert [g["numa_node"] for g in topology["gpus"]] == [None, None]  # no sysfs, not recorded


def test_the_process_exits_at_its_timeout_while_nvml_hangs(write_config, tmp_path) -> None:
    """The verdict at the deadline is not enough: the process must exit then too. A pool
    worker blocked on a hung call held the interpreter's exit for the whole NVML call
    timeout (5.3 s for `--timeout 2` as a Slurm prolog measured it)."""
    hung = _hanging(tmp_path, {"device": 1, "call": "temperature*", "hang": True})
    cfg = write_config(NO_XID, nvml=hung)
    cfg.write_text(
        cfg.read_text().replace(f"replay: {hung}}}", f"replay: {hung}, call_timeout: 20}}")
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check", "--timeout", "2", "--config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode in (2, 3), proc.stdout + proc.stderr
    assert "nvml no answer within 2s" in proc.stdout
    assert elapsed < 10, f"exited after {elapsed:.1f}s; the NVML call timeout is 20 s"
