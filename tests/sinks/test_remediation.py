"""Remediation against a real Slurm (munged, slurmctld, slurmd on loopback):
drain with our reason after the hold time, never on a warning, the fleet
guard read from Slurm, and resume only through `gpuwatchd clear --resume`."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.diag.run import FAKE_WORKER_ENV
from gpuwatchd.model import Action, Finding, Severity, labels_of
from gpuwatchd.sinks.remediation.policy import due, reason_text
from gpuwatchd.sinks.remediation.sink import RemediationSink, engaged_actions, spread_offset
from gpuwatchd.sinks.remediation.slurm import parse_sinfo
from gpuwatchd.sinks.store import EventStore
from tests.diag.fakes import H100_IDLE, HEALTHY_H100, HEALTHY_H100_STANDARD, canned, result
from tests.slurm_cluster import SlurmCluster, slurm_cluster

HOLD = 300.0
T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory)


def finding(severity: Severity = Severity.CRITICAL, since: float = T0, name: str = "") -> Finding:
    alert = name or ("GpuXidCritical" if severity == Severity.CRITICAL else "GpuXidWarning")
    return Finding(
        rule="xid",
        alertname=alert,
        scope="gpu",
        subject=labels_of({"gpu": "3", "uuid": "GPU-3", "pci_bus_id": "0000:3b:00.0"}),
        severity=severity,
        reason="Xid 79 on GPU 3: fallen off the bus",
        action=Action.REBOOT_NODE,
        remediation="Reboot the node; if it recurs, reseat or replace the GPU.",
        since=since,
    )


def make_cfg(
    tmp_path: Path, node: str = "", drain: bool = True, extra: str = "", spread: float = 0
) -> Config:
    scontrol = shutil.which("scontrol") or "scontrol"
    text = f"""
daemon: {{state_dir: {tmp_path / "state"}}}
remediation:
  hold_seconds: {HOLD}
  slurm: {{drain_on: {"[critical]" if drain else "[]"}, node_name: "{node}",
          scontrol: {scontrol}, timeout: 10, max_drains: 1, spread_seconds: {spread}}}
{extra}
"""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return config.load(str(path))


def test_due_needs_critical_held_for_the_hold_time(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    assert due(cfg, [finding()], T0 + HOLD - 1, ()) == []
    [d] = due(cfg, [finding()], T0 + HOLD, ())
    assert d.action == "slurm_drain"
    assert due(cfg, [finding()], T0 + HOLD, ("slurm_drain",)) == []
    assert due(cfg, [finding(Severity.WARNING)], T0 + 10 * HOLD, ()) == []
    assert due(make_cfg(tmp_path, drain=False), [finding()], T0 + 10 * HOLD, ()) == []


def test_alert_list_limits_what_acts(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, extra="  alerts: [GpuLost]")
    assert due(cfg, [finding()], T0 + HOLD, ()) == []
    assert due(cfg, [finding(name="GpuLost")], T0 + HOLD, ())


def test_reason_is_one_bounded_line() -> None:
    text = reason_text(finding())
    assert text.startswith("gpuwatchd: GpuXidCritical gpu 3: Reboot the node")
    long = reason_text(
        Finding("r", "A", "gpu", (), Severity.CRITICAL, "x", remediation="y\n" * 500)
    )
    assert len(long) <= 200 and "\n" not in long


def test_warning_severity_cannot_be_configured(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("remediation: {slurm: {drain_on: [warning]}}\n")
    with pytest.raises(config.ConfigError if hasattr(config, "ConfigError") else Exception) as exc:
        config.load(str(tmp_path / "c.yaml"))
    assert "remediation.slurm.drain_on" in str(exc.value)


def test_parse_sinfo() -> None:
    text = (
        "n1|drained|2026-11-23T20:01:02|gpuwatchd: GpuLost gpu 1: reboot\n"
        "n2|idle|Unknown|none\n"
        "n3|mixed+drain|2026-11-23T20:01:02|gpuwatchd: GpuLost gpu 2: reboot\n"
        "n1|drained|2026-11-23T20:01:02|gpuwatchd: GpuLost gpu 1: reboot\n"
        "garbage\n"
    )
    nodes = parse_sinfo(text)
    assert sorted(nodes) == ["n1", "n2", "n3"]
    assert nodes["n1"].drained and not nodes["n2"].drained and nodes["n3"].drained
    assert nodes["n2"].reason == "" and nodes["n2"].reason_time == 0.0


def _state(slurm: SlurmCluster) -> tuple[str, str]:
    out = slurm.run(["sinfo", "-h", "-N", "-n", slurm.node, "-o", "%T|%E"]).stdout
    state, _, reason = out.strip().splitlines()[0].partition("|")
    return state.rstrip("*~#$@^-!%"), reason  # flags such as * (not responding) aside


def _wait_state(slurm: SlurmCluster, want: str, timeout: float = 15.0) -> tuple[str, str]:
    end = time.monotonic() + timeout
    got = _state(slurm)
    while not got[0].startswith(want) and time.monotonic() < end:
        time.sleep(0.2)
        got = _state(slurm)
    return got


def healthy_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[dict[str, object]]
) -> str:
    """Config text and environment for a diag run over a replayed H100 and a fake worker."""
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, lines))
    return f"sources: {{nvml: {{replay: {H100_IDLE}}}}}"


@pytest.mark.timeout(120)
def test_drain_with_reason_then_resume_on_clear(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    cfg = make_cfg(
        tmp_path,
        node=slurm.node,
        extra=healthy_gpus(tmp_path, monkeypatch, HEALTHY_H100_STANDARD),
    )
    clock = FakeClock(T0)
    store = EventStore.from_config(cfg, clock.time)
    sink = RemediationSink(cfg, clock, slurm.node, store, env=slurm.env)
    try:
        # A warning held for an hour never drains.
        sink.update([finding(Severity.WARNING)])
        assert sink.step(T0 + 12 * HOLD) == []
        assert _state(slurm)[0] == "idle"

        sink.update([finding()])
        assert sink.step(T0 + HOLD - 1) == []
        assert _state(slurm)[0] == "idle"
        [d] = sink.step(T0 + HOLD)
        assert d.action == "slurm_drain"
        state, reason = _wait_state(slurm, "drain")
        assert state in ("drained", "draining", "drain")
        assert reason.startswith("gpuwatchd: GpuXidCritical gpu 3: Reboot the node")
        # Engaged: no second drain, and the metric and the stored event say so.
        assert sink.step(T0 + HOLD + 5) == []
        samples = {(s.name, s.labels): s.value for s in sink.samples()}
        key = (
            "gpuwatchd_remediation_actions_total",
            (("action", "slurm_drain"), ("result", "done")),
        )
        assert samples[key] == 1
        assert samples[("gpuwatchd_remediation_engaged", (("action", "slurm_drain"),))] == 1
        rows = store.recent(10, kind="remediation")
        assert rows[0]["attrs"]["result"] == "done"
        assert engaged_actions(store)[0] == {"slurm_drain"}

        # Only an operator brings it back.
        state_dir = str(tmp_path / "state")
        assert main(["clear", "--resume", "--config", str(tmp_path / "config.yaml"),
                     "--state-dir", state_dir, "--reason", "GPU reseated"]) == 0  # fmt: skip
        assert _wait_state(slurm, "idle")[0] == "idle"
        clock.advance(1.0)
        sink.update([finding(since=T0)])
        resumed_at = engaged_actions(store)[1]
        assert sink.step(resumed_at + 1) == []  # the old condition must hold again
        assert engaged_actions(store)[0] == set()
    finally:
        sink.stop()
        store.close()
        slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=resume"], check=False)


@pytest.mark.timeout(120)
def test_fleet_guard_reads_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Another node already drained by gpuwatchd: with max_drains 1 this one holds back."""
    slurm.run(
        ["scontrol", "update", f"nodename={slurm.node}", "state=drain",
         "reason=gpuwatchd: GpuLost gpu 0: reboot"]
    )  # fmt: skip
    node = "gpu-node-that-is-not-drained"
    cfg = make_cfg(tmp_path, node=node, spread=30)
    store = EventStore.from_config(cfg, time.time)
    sink = RemediationSink(cfg, FakeClock(T0), "x", store, env=slurm.env)
    try:
        now = time.time()
        offset = spread_offset(node, 30)
        # Held for the hold time, but not yet for this node's share of the spread.
        sink.update([finding(since=now - HOLD - offset + 1)])
        assert sink.step(now) == []
        sink.update([finding(since=now - HOLD - offset)])
        [d] = sink.step(now)
        assert d.action == "slurm_drain"
        rows = store.recent(10, kind="remediation")
        assert rows[0]["attrs"]["result"] == "guarded"
        assert slurm.node in rows[0]["message"]
        assert engaged_actions(store)[0] == set()
        assert sink.step(now + 1) == []  # backs off before asking Slurm again
    finally:
        sink.stop()
        store.close()
        slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=resume"], check=False)


XID79 = (
    "[ 8123.456789] NVRM: Xid (PCI:0000:00:06): 79, pid='<unknown>', name=<unknown>,"
    " GPU has fallen off the bus.\n"
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_daemon_drains_on_xid79_and_clear_resumes(
    slurm: SlurmCluster, tmp_path: Path, start_daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole chain: kernel log -> Xid stage -> health engine -> remediation -> Slurm."""
    from tests.conftest import FIXTURES

    (tmp_path / "shm").mkdir()
    kern = tmp_path / "kern.log"
    kern.write_text("")
    scontrol = shutil.which("scontrol") or "scontrol"
    cfg = f"""
paths: {{sysfs: {FIXTURES / "sys"}, dev_shm: {tmp_path / "shm"}}}
sources:
  nvml: {{interval: 1}}
  kmsg: {{backend: file, file: {kern}}}
  udev: {{enabled: false}}
remediation:
  hold_seconds: 2
  slurm: {{drain_on: [critical], node_name: "{slurm.node}", scontrol: {scontrol},
          spread_seconds: 0}}
"""
    capture = FIXTURES / "nvml" / "h200x2-probe.json"
    d = start_daemon(cfg, "--nvml-replay", str(capture), env={"SLURM_CONF": str(slurm.conf)})
    try:
        assert _state(slurm)[0] == "idle"
        with kern.open("a") as fh:
            fh.write(XID79)
        state, reason = _wait_state(slurm, "drain", timeout=30)
        assert state.startswith("drain"), d.output()[-3000:]
        assert reason.startswith("gpuwatchd: GpuXidCritical gpu 0: "), reason
        engaged = 'gpuwatchd_remediation_engaged{action="slurm_drain"} 1.0'
        end = time.monotonic() + 10  # the consumer thread publishes the sink's samples each second
        while engaged not in d.get("/metrics")[1].decode() and time.monotonic() < end:
            time.sleep(0.2)
        assert engaged in d.get("/metrics")[1].decode()
        status, body = d.get("/events?kind=remediation")
        assert b'"result": "done"' in body or b'"result":"done"' in body
        # Evidence first: the Xid's bundle exists and the drain names it.
        bundles = json.loads(d.get("/evidence")[1])["bundles"]
        assert [b["incident"].split("|")[0] for b in bundles] == ["GpuXidCritical"]
        assert f"(evidence {bundles[0]['id']})".encode() in body
        status, one = d.get(f"/evidence/{bundles[0]['id']}")
        assert status == 200 and b"Xid" in json.loads(one)["kmsg.txt"].encode()

        monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
        # NVML is the daemon's replay, not the config's: this test is about the chain.
        args = ["clear", "--all", "--resume", "--force", "--config", str(d.config)]
        assert main([*args, "--state-dir", str(tmp_path / "state")]) == 0
        assert _wait_state(slurm, "idle")[0] == "idle"
        time.sleep(4)  # two hold times: the cleared Xid must not drain again
        assert _state(slurm)[0] == "idle", d.output()[-3000:]
    finally:
        slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=resume"], check=False)


def _drain(slurm: SlurmCluster, cfg: Config, tmp_path: Path) -> tuple[RemediationSink, EventStore]:
    # Real time: the CLI's store prunes by its own clock.
    now = time.time()
    clock = FakeClock(now)
    store = EventStore.from_config(cfg, clock.time)
    sink = RemediationSink(cfg, clock, slurm.node, store, env=slurm.env)
    sink.update([finding(since=now - HOLD)])
    [d] = sink.step(now)
    assert d.action == "slurm_drain"
    assert _wait_state(slurm, "drain")[0].startswith("drain")
    return sink, store


@pytest.mark.timeout(120)
def test_resume_refused_when_diag_fails_and_forced_resume_recorded(
    slurm: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    slow = [result("gemm", "0", 200.0, "TFLOP/s"), result("d2d_bandwidth", "0", 3000.0, "GB/s")]
    cfg = make_cfg(tmp_path, node=slurm.node, extra=healthy_gpus(tmp_path, monkeypatch, slow))
    sink, store = _drain(slurm, cfg, tmp_path)
    args = ["clear", "--resume", "--config", str(tmp_path / "config.yaml")]
    try:
        assert main(args) == 2  # CRITICAL: the GEMM is below its floor
        out = capsys.readouterr()
        assert "FAIL      gemm" in out.out and "not resumed: diag standard CRITICAL" in out.err
        time.sleep(1.0)
        assert _state(slurm)[0].startswith("drain")  # still out of service
        assert engaged_actions(store)[0] == {"slurm_drain"}
        results = [r["attrs"]["result"] for r in store.recent(10, kind="remediation")]
        assert results[0] == "resume_refused"
        [fail] = store.recent(5, kind="diag_fail")
        assert fail["attrs"]["check"] == "gemm" and fail["pci_bus_id"]
        [run] = store.recent(5, kind="diag")
        assert run["attrs"]["trigger"] == "resume" and run["attrs"]["verdict"] == "CRITICAL"

        assert main([*args, "--force", "--reason", "GPU swapped"]) == 0
        assert _wait_state(slurm, "idle")[0] == "idle"
        results = [r["attrs"]["result"] for r in store.recent(10, kind="remediation")]
        assert results[:2] == ["resumed", "resume_forced"]
        assert len(store.recent(5, kind="diag")) == 1  # --force ran no diag
    finally:
        sink.stop()
        store.close()
        slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=resume"], check=False)


@pytest.mark.timeout(120)
def test_resume_waits_while_a_gpu_is_busy(
    slurm: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import sys

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    capture = json.loads(H100_IDLE.read_text())
    capture["script"] = [
        {
            "device": 0,
            "call": "compute_running_processes",
            "value": [{"pid": other.pid, "used_memory": 1}],
        }
    ]
    (tmp_path / "busy.json").write_text(json.dumps(capture))
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, HEALTHY_H100))
    cfg = make_cfg(
        tmp_path, node=slurm.node, extra=f"sources: {{nvml: {{replay: {tmp_path / 'busy.json'}}}}}"
    )
    sink, store = _drain(slurm, cfg, tmp_path)
    try:
        assert main(["clear", "--resume", "--config", str(tmp_path / "config.yaml")]) == 3
        assert _state(slurm)[0].startswith("drain")
        [run] = store.recent(5, kind="diag")
        assert run["attrs"]["cancelled"] == f"GPU in use by process {other.pid}"
        assert store.recent(5, kind="diag_fail") == []  # busy is not a failure
    finally:
        other.kill()
        other.wait()
        sink.stop()
        store.close()
        slurm.run(["scontrol", "update", f"nodename={slurm.node}", "state=resume"], check=False)


def test_clear_needs_a_target_and_resume_alone_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(tmp_path / "state")
    assert main(["clear", "--state-dir", state]) == 64  # EX_USAGE, never 2 (CRITICAL)
    assert "one of --gpu, --all or --resume" in capsys.readouterr().err
    assert main(["clear", "--resume", "--state-dir", state]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    store = EventStore(str(tmp_path / "state" / "gpuwatchd.db"))
    try:
        [row] = store.recent(5, kind="remediation")
        assert row["attrs"]["result"] == "resumed"
    finally:
        store.close()


def test_spread_offset_is_fixed_per_node_and_within_the_spread() -> None:
    offsets = {spread_offset(f"gpu-node-{i:03d}", 30.0) for i in range(64)}
    assert all(0 <= o < 30.0 for o in offsets)
    assert len(offsets) == 64  # distinct: the guard is consulted one node after another
    assert spread_offset("gpu-node-001", 30.0) == spread_offset("gpu-node-001", 30.0)
    assert spread_offset("gpu-node-001", 0.0) == 0.0
