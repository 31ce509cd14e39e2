"""Every alert leaves through the health engine's findings and the one AlertSink.

Job hangs used to leave through a second sink (hang-alerts.db) built once at start: a
reload did not move it, /alerts, /status and the delivery metrics did not see it, and
health.disabled_rules and for_seconds did not apply. Each test below failed so. A real
Alertmanager on loopback receives; the hang is the recorded H100 dead-peer replay.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml

from gpuwatchd import app
from gpuwatchd.clock import FakeClock
from gpuwatchd.config import AlertmanagerConfig, Config, DaemonConfig, HealthConfig
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.health.alerts import ALERTS
from gpuwatchd.model import Finding, Severity
from gpuwatchd.pipeline.daemon import Pipeline
from gpuwatchd.sinks.alertmanager.sink import AlertSink
from gpuwatchd.state import State
from tests.conftest import ROOT
from tests.hangs.replay import polls
from tests.servers import AlertmanagerServer, alertmanager_server

# Alerts only Prometheus can raise: about the daemon itself (down, or its own deliveries
# refused), so the daemon cannot be the one to send them.
PROMETHEUS_ONLY = {"GpuwatchdDown", "GpuwatchdAlertsRejected"}


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    yield from alertmanager_server(tmp_path_factory)


def _dead_url() -> str:
    """An Alertmanager URL where nothing listens (a receiver since taken away)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _pipeline(tmp_path: Path, urls: list[str], clock: FakeClock, **health: object) -> Pipeline:
    cfg = Config(
        daemon=DaemonConfig(state_dir=str(tmp_path / "state")),
        alertmanager=AlertmanagerConfig(urls=urls, resend_interval=1.0),
        hangs=HangsConfig(ras=False, ras_poll=False, stacks=False, flight_recorder=False),
        health=HealthConfig(**health),  # type: ignore[arg-type]
    )
    pipeline = Pipeline(cfg, State(), clock, tmp_path.name, 0, [])
    pipeline.sink.start()
    return pipeline


def _hang(pipeline: Pipeline) -> None:
    """Replay the dead-peer recording (the fault 150 s ago) into the daemon's monitor."""
    base = time.time() - 150
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        pipeline.hangs.observe(jobs, gpus, base + t)
        pipeline.hangs.run_pending()
    assert pipeline.hangs.findings()


def _sinks(pipeline: Pipeline) -> list[AlertSink]:
    return [v for v in vars(pipeline).values() if isinstance(v, AlertSink)]


def _received(pipeline: Pipeline, am: AlertmanagerServer) -> list[dict[str, object]]:
    for sink in _sinks(pipeline):
        sink.flush(3.0)
    return am.alerts(node=pipeline._node, alertname="JobHangSuspected")


def test_a_reload_moves_hang_alerts_to_the_new_receivers(
    tmp_path: Path, am: AlertmanagerServer
) -> None:
    pipeline = _pipeline(tmp_path, [_dead_url()], FakeClock(time.time()))
    try:
        _hang(pipeline)
        pipeline.tick()
        cfg = pipeline.cfg
        pipeline.reconfigure(
            dataclasses.replace(cfg, alertmanager=AlertmanagerConfig(urls=[am.url]))
        )
        pipeline.tick()
        [alert] = _received(pipeline, am)
        assert alert["labels"]["severity"] == "critical"  # type: ignore[index]
        assert "rank 1 died" in alert["annotations"]["description"]  # type: ignore[index]
    finally:
        pipeline.stop(timeout=2.0)


def test_hang_alerts_show_in_alerts_status_and_the_delivery_metrics(
    tmp_path: Path, am: AlertmanagerServer
) -> None:
    pipeline = _pipeline(tmp_path, [am.url], FakeClock(time.time()))
    try:
        _hang(pipeline)
        pipeline.tick()
        assert _received(pipeline, am)
        _, _, body = pipeline.routes()["/alerts"]({})
        assert "JobHangSuspected" in body.decode()
        assert "JobHangSuspected" in json.dumps(pipeline.status()["alerts"])
        firing = {s.label("severity"): s.value for s in pipeline.sink.samples()
                  if s.name == "gpuwatchd_alerts_firing"}  # fmt: skip
        assert firing.get("critical") == 1  # what GpuwatchdAlertsRejected's sink counts
    finally:
        pipeline.stop(timeout=2.0)


def test_disabled_rules_silence_a_hang_alert(tmp_path: Path, am: AlertmanagerServer) -> None:
    pipeline = _pipeline(
        tmp_path, [am.url], FakeClock(time.time()), disabled_rules=["JobHangSuspected"]
    )
    try:
        _hang(pipeline)
        pipeline.tick()
        assert _received(pipeline, am) == []
        assert pipeline.hangs.records()  # still detected, stored and on /hangs
    finally:
        pipeline.stop(timeout=2.0)


def test_for_seconds_holds_a_hang_alert_back(tmp_path: Path, am: AlertmanagerServer) -> None:
    clock = FakeClock(time.time())
    pipeline = _pipeline(tmp_path, [am.url], clock, for_seconds={"JobHangSuspected": 60.0})
    try:
        _hang(pipeline)
        pipeline.tick()
        assert _received(pipeline, am) == []
        clock.advance(61.0)
        pipeline.tick()
        assert len(_received(pipeline, am)) == 1
    finally:
        pipeline.stop(timeout=2.0)


def test_a_hang_found_off_the_consumer_thread_leaves_at_once(
    tmp_path: Path, am: AlertmanagerServer
) -> None:
    # The hang probe decides on its own thread; the alert used to wait for the consumer's
    # next 1 s tick (1.0 s after the verdict on an H200). The fake clock never reaches
    # that tick here, so only the wake can send it.
    pipeline = _pipeline(tmp_path, [am.url], FakeClock(time.time()))
    pipeline.start()
    try:
        assert pipeline.wait_idle(5.0)
        time.sleep(0.2)  # the consumer's first tick is done: the next is never due
        t0 = time.monotonic()
        _hang(pipeline)  # the test's thread stands for the hang-probe thread
        while "JobHangSuspected" not in pipeline.routes()["/alerts"]({})[2].decode():
            assert time.monotonic() - t0 < 5.0, "the hang alert waited for a tick"
            time.sleep(0.01)
    finally:
        pipeline.stop(timeout=2.0)


def test_the_old_hang_outbox_is_retired_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    for name in ("hang-alerts.db", "hang-alerts.db-wal", "hang-alerts.db-shm"):
        (state / name).write_bytes(b"old")
    cfg = Config(daemon=DaemonConfig(state_dir=str(state)))
    pipeline = app.assemble(app.Mode.DAEMON, cfg, State(), FakeClock())
    pipeline.stop(timeout=1.0)
    assert sorted(p.name for p in state.iterdir() if p.name.startswith("hang-")) == []


class _Every:
    """A findings provider holding one finding of every alert the daemon can raise."""

    version = 1

    def findings(self) -> Sequence[Finding]:
        out = []
        for name, info in sorted(ALERTS.items()):
            labels = tuple((k, f"{k}-1") for k in sorted({*info.labels, "job", "gpu"}))
            out.append(
                Finding("test", name, "node", (("check", name),), info.severity, name,
                        info.action, "", labels)
            )  # fmt: skip
        return out


def _alert_names_in_the_project() -> set[str]:
    names = set(ALERTS)
    for rules in (ROOT / "deploy").rglob("*rules*.yaml"):
        for group in yaml.safe_load(rules.read_text()).get("groups", []):
            names |= {r["alert"] for r in group.get("rules", []) if "alert" in r}
    names |= {p.stem for p in (ROOT / "docs" / "runbooks").glob("*.md")} - {"README"}
    return names


def test_every_alert_name_leaves_through_the_one_sink(tmp_path: Path) -> None:
    names = _alert_names_in_the_project()
    assert "JobHangSuspected" in names and len(names) > 30
    assert names - set(ALERTS) == PROMETHEUS_ONLY  # every other one the daemon raises
    no_delay = {name: 0.0 for name in ALERTS}  # a `for` delay is tested above
    pipeline = _pipeline(tmp_path, [], FakeClock(time.time()), for_seconds=no_delay)
    try:
        pipeline.engine.add_provider("every", _Every())
        pipeline.tick()
        _, _, body = pipeline.routes()["/alerts"]({})
        sent = {a["labels"]["alertname"] for a in json.loads(body)["alerts"]}
        assert sent == set(ALERTS)
        assert _sinks(pipeline) == [pipeline.sink]
    finally:
        pipeline.stop(timeout=2.0)
    # and the package builds that one sink in one place, fed by the engine alone
    built = []
    for path in (ROOT / "gpuwatchd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "AlertSink":
                built.append(path.relative_to(ROOT).as_posix())
    assert built == ["gpuwatchd/pipeline/daemon.py"]
    source = (ROOT / "gpuwatchd" / "pipeline" / "daemon.py").read_text()
    assert source.count("sink.update)") == source.count(
        "self.engine.add_listener(self.sink.update)"
    )


def test_a_hang_in_the_engine_leaves_node_health_remediation_and_diag_alone(
    tmp_path: Path,
) -> None:
    # as before the one path: a hung job is its owner's to restart, not the node's sickness
    from gpuwatchd.config.remediation import RemediationConfig, SlurmRemediationConfig
    from gpuwatchd.model import Health
    from gpuwatchd.sinks.remediation import policy

    clock = FakeClock(time.time())
    pipeline = _pipeline(tmp_path, [], clock)
    try:
        _hang(pipeline)
        pipeline.tick()
        [hang] = pipeline.engine.open_findings()
        assert hang.alertname == "JobHangSuspected" and hang.severity == Severity.CRITICAL
        assert pipeline.engine.rollup().node == Health.HEALTHY
        drain = dataclasses.replace(
            pipeline.cfg,
            remediation=RemediationConfig(slurm=SlurmRemediationConfig(drain_on=["critical"])),
        )
        assert policy.enabled_actions(drain) == ["slurm_drain"]
        assert policy.due(drain, [hang], clock.time() + 86400, []) == []
        cfg = pipeline.diag.cfg
        pipeline.diag.cfg = dataclasses.replace(
            cfg, diag=dataclasses.replace(cfg.diag, after_critical=True)
        )
        pipeline.diag.update([hang])
        pipeline.diag.update([])  # the hang resolved: no after_critical run owed
        assert pipeline.diag.status()["pending"] == ""
        gpu = dataclasses.replace(hang, scope="gpu")  # what a GPU's critical condition does
        pipeline.diag.update([gpu])
        pipeline.diag.update([])
        assert pipeline.diag.status()["pending"] == "after_critical"
    finally:
        pipeline.stop(timeout=2.0)
