"""Evidence bundles: contents, one per incident, bounds on size and count, CLI and route."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import main
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.model import Action, Event, Finding, Sample, Severity, SourceSnapshot, labels_of
from gpuwatchd.sinks.evidence import (
    CHAIN_GAP,
    EvidenceRecorder,
    evidence_route,
    incident_key,
    list_bundles,
    read_kmsg,
)
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
    assert sorted(kept) == sorted([ids[0], ids[2]])  # the oldest after the chain's first went
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


# --- drills: evidence off the consumer thread, damaged bundles, pruning a cascade -------


def _cascade(n: int) -> list[Finding]:
    """n critical incidents at once, as a GPU falling off the bus raises them."""
    return [xid79(str(g)) for g in range(n)]


def test_a_cascade_on_a_large_kernel_log_never_holds_the_consumer(tmp_path: Path) -> None:
    """60 incidents and a 64 MiB kern.log: the listener returns at once (it read the
    whole file per bundle on the consumer thread: 51.6 s for 314 MB and 60 incidents)."""
    kern = tmp_path / "kern.log"
    line = b"Nov 29 00:00:00 node kernel: " + b"x" * 98 + b"\n"
    with kern.open("wb") as f:
        f.write(line * (64 * 1024 * 1024 // len(line)) + b"6,1,0,-;the newest line\n")
    cfg = _cfg(tmp_path, "{kmsg_records: 50, max_bundles: 60}")
    rec = EvidenceRecorder(cfg, None, _state())
    rec.start()
    try:
        began = time.monotonic()
        rec.update(_cascade(60))
        took = time.monotonic() - began
    finally:
        rec.stop(timeout=30)
    assert took < 2.0, f"the listener held the consumer thread {took:.1f}s"
    bundles = {m["incident"]: m for m in list_bundles(cfg)}
    assert len(bundles) == 60
    first = bundles[incident_key(xid79("0"))]
    assert first["chain_first"] is True
    kmsg = Path(cfg.daemon.state_dir) / "evidence" / first["id"] / "kmsg.txt"
    lines = kmsg.read_text().splitlines()
    assert len(lines) == 50 and lines[-1] == "6,1,0,-;the newest line"


def test_a_full_queue_drops_and_counts_but_never_a_chains_first(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "{kmsg_records: 10, max_bundles: 200}")
    clock = FakeClock()
    rec = EvidenceRecorder(cfg, None, clock=clock)
    rec.start()
    try:
        with rec._write_lock:  # the writer busy on a slow disk
            rec.update(_cascade(100))
            clock.advance(CHAIN_GAP + 1)
            rec.update([xid79("200")])  # a new chain's first, with the queue full
    finally:
        rec.stop(timeout=30)
    kept = {m["incident"]: m for m in list_bundles(cfg)}
    assert incident_key(xid79("0")) in kept and kept[incident_key(xid79("200"))]["chain_first"]
    samples = {(s.name, s.label("reason")): s.value for s in rec.samples()}
    dropped = samples[("gpuwatchd_evidence_bundles_dropped_total", "queue_full")]
    written = samples[("gpuwatchd_evidence_bundles_written_total", "")]
    assert dropped >= 36 and written + dropped == 101 and written == len(kept)


def test_read_kmsg_reads_a_file_from_its_end(tmp_path: Path) -> None:
    kern = tmp_path / "kern.log"
    kern.write_bytes(b"".join(b"line %d\n" % i for i in range(200_000)) + b"partial")
    assert read_kmsg(str(kern), 3) == ["line 199998", "line 199999", "partial"]
    kern.write_bytes(b"a\r\nb\n")
    assert read_kmsg(str(kern), 10) == ["a", "b"]
    assert read_kmsg(str(kern), 0) == []


def test_a_damaged_bundle_is_moved_aside_not_fatal(tmp_path: Path) -> None:
    """`"time": null` in one meta.json raised in list_bundles at every start (exit 70)."""
    cfg = _cfg(tmp_path)
    good = EvidenceRecorder(cfg, None).ensure(xid79("0"), "raised")
    root = Path(cfg.daemon.state_dir) / "evidence"
    bad = root / "20261128T000000Z-0000000000"
    bad.mkdir()
    (bad / "meta.json").write_text('{"id": "20261128T000000Z-0000000000", "time": null}')
    (root / "20261128T000001Z-1111111111").mkdir()  # no meta.json at all
    (root / "20261128T000002Z-2222222222").mkdir()
    (root / "20261128T000002Z-2222222222" / "meta.json").write_text("{not json")
    assert [m["id"] for m in list_bundles(cfg)] == [good]  # readers skip them
    rec = EvidenceRecorder(cfg, None)
    assert len(rec.quarantined) == 3
    names = sorted(p.name for p in root.iterdir())
    assert sum(".corrupt-" in n for n in names) == 3 and good in names
    assert [s.value for s in rec.samples() if "quarantined" in s.name] == [3.0]
    assert rec.ensure(xid79("0"), "before remediation") == good
    assert len(EvidenceRecorder(cfg, None).quarantined) == 0  # moved once


def test_pruning_keeps_the_first_bundle_of_an_incident_chain(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "{max_bundles: 3, kmsg_records: 10}")
    clock = FakeClock()
    rec = EvidenceRecorder(cfg, None, clock=clock)
    root_cause = rec.ensure(xid79("0"), "raised")
    for g in range(1, 6):  # the cascade: each within CHAIN_GAP of the one before
        clock.advance(30)
        rec.ensure(xid79(str(g)), "raised")
    kept = [m["id"] for m in list_bundles(cfg)]
    assert root_cause in kept and len(kept) == 3
    clock.advance(CHAIN_GAP + 1)  # a new chain, much later
    second_root = rec.ensure(xid79("7"), "raised")
    assert {root_cause, second_root} <= {m["id"] for m in list_bundles(cfg)}


def test_ensure_never_names_a_pruned_bundle(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "{max_bundles: 1, kmsg_records: 10}")
    clock = FakeClock()
    rec = EvidenceRecorder(cfg, None, clock=clock)
    rec.ensure(xid79("0"), "raised")
    clock.advance(1)
    rec.ensure(xid79("1"), "raised")  # the only bundle kept now
    clock.advance(1)
    again = rec.ensure(xid79("0"), "before remediation")
    assert (Path(cfg.daemon.state_dir) / "evidence" / again / "meta.json").exists()
