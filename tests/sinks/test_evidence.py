"""Evidence bundles: contents, one per incident, bounds on size and count, CLI and route."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.config import Config
from gpuwatchd.model import Action, Event, Finding, Sample, Severity, SourceSnapshot, labels_of
from gpuwatchd.sinks.evidence import EvidenceRecorder, evidence_route, list_bundles
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.state import State


def _cfg(tmp_path: Path, evidence: str = "{}") -> Config:
    kern = tmp_path / "kern.log"
    if not kern.exists():
        kern.write_text("".join(f"6,{i},0,-;line {i}\n" for i in range(5000)))
    path = tmp_path / "config.yaml"
    path.write_text(
        f"daemon: {{state_dir: {tmp_path / 'state'}}}\n"
        f"paths: {{kmsg: {kern}}}\nevidence: {evidence}\n"
    )
    return config.load(str(path))


def xid79(gpu: str = "0", severity: Severity = Severity.CRITICAL) -> Finding:
    return Finding(
        rule="xid",
        alertname="GpuXidCritical",
        scope="gpu",
        subject=labels_of({"gpu": gpu, "uuid": f"GPU-{gpu}", "pci_bus_id": f"0000:0{gpu}:00.0"}),
        severity=severity,
        reason="Xid 79: fallen off the bus",
        action=Action.REBOOT_NODE,
        remediation="reboot",
        since=1.0,
    )


def _state() -> State:
    state = State()
    s = Sample.of("gpuwatchd_gpu_temperature_celsius", 41, gpu="0", uuid="GPU-0", sensor="gpu")
    state.publish(SourceSnapshot("nvml", (s,), True, "", timestamp=1.0))
    return state


def test_bundle_holds_kernel_log_nvml_events_and_the_finding(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "{kmsg_records: 100}")
    os.makedirs(cfg.daemon.state_dir)
    store = EventStore.from_config(cfg)
    store.write(
        [(Event("xid", "kmsg", 1.0, code=79, pci_bus_id="0000:00:00.0", message="Xid 79"), "", 1)]
    )
    rec = EvidenceRecorder(cfg, store, _state())
    bid = rec.ensure(xid79(), "raised")
    d = Path(cfg.daemon.state_dir) / "evidence" / bid
    kmsg = (d / "kmsg.txt").read_text().splitlines()
    assert kmsg[0] == "6,4900,0,-;line 4900" and kmsg[-1] == "6,4999,0,-;line 4999"
    assert 'gpuwatchd_gpu_temperature_celsius{gpu="0",' in (d / "nvml.txt").read_text()
    assert json.loads((d / "events.json").read_text())[0]["code"] == 79
    assert json.loads((d / "finding.json").read_text())["alertname"] == "GpuXidCritical"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["incident"].startswith("GpuXidCritical|gpu=0") and meta["why"] == "raised"
    # One incident, one bundle: the remediation asking again gets the same id.
    assert rec.ensure(xid79(), "before remediation") == bid
    # A restarted daemon knows it too.
    assert EvidenceRecorder(cfg, store, None).ensure(xid79(), "raised") == bid
    assert len(list_bundles(cfg)) == 1
    store.close()


def test_only_critical_findings_open_a_bundle(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    rec = EvidenceRecorder(cfg, None)
    rec.update([xid79("1", Severity.WARNING)])
    assert list_bundles(cfg) == []
    rec.update([xid79("1")])
    assert len(list_bundles(cfg)) == 1


def test_bounded_in_count_and_size(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "{max_bundles: 2, max_bundle_bytes: 20000}")
    rec = EvidenceRecorder(cfg, None)
    ids = [rec.ensure(xid79(str(g)), "raised") for g in range(3)]
    kept = [m["id"] for m in list_bundles(cfg)]
    assert sorted(kept) == sorted(ids[1:])  # the oldest went
    for bid in kept:
        d = Path(cfg.daemon.state_dir) / "evidence" / bid
        total = sum(f.stat().st_size for f in d.iterdir())
        assert total <= 20000
        kmsg = (d / "kmsg.txt").read_text()
        assert kmsg.startswith("(cut to fit the bundle)") and kmsg.endswith("line 4999\n")


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "{enabled: false}")
    assert EvidenceRecorder(cfg, None).ensure(xid79(), "raised") == ""
    assert list_bundles(cfg) == []


def test_bug_report_runs_when_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "nvidia-bug-report.sh"
    script.write_text('#!/bin/sh\n[ "$1" = --output-file ] && echo report | gzip > "$2.gz"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    cfg = _cfg(tmp_path, "{bug_report: true}")
    bid = EvidenceRecorder(cfg, None).ensure(xid79(), "raised")
    [meta] = list_bundles(cfg)
    assert meta["id"] == bid and meta["files"]["nvidia-bug-report.log.gz"] > 0


def test_cli_and_route(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(tmp_path)
    bid = EvidenceRecorder(cfg, None).ensure(xid79(), "raised")
    args = ["--config", str(tmp_path / "config.yaml")]
    assert main(["evidence", "list", *args]) == 0
    assert f"{bid}  " in capsys.readouterr().out
    assert main(["evidence", "show", bid, "--json", *args]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["id"] == bid
    route = evidence_route(cfg)
    status, _, body = route({"id": [bid]})
    assert status == 200 and "kmsg.txt" in json.loads(body)
    assert route({"id": ["../../etc"]})[0] == 404
    assert json.loads(route({})[2])["count"] == 1
