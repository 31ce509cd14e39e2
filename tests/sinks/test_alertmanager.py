"""The Alertmanager sink against a real Alertmanager on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.clock import SystemClock
from gpuwatchd.config import AlertmanagerConfig, Config
from gpuwatchd.errors import ConfigError
from gpuwatchd.model import Action, Finding, GpuInventory, Severity, labels_of
from gpuwatchd.sinks.alertmanager.sink import AlertSink, validate_config
from gpuwatchd.state import State
from tests.health.snapshots import GPU0, GPU1
from tests.servers import AlertmanagerServer, alertmanager_server, free_port


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    yield from alertmanager_server(tmp_path_factory)


def config(urls: list[str], **am: Any) -> Config:
    return dataclasses.replace(
        Config(), alertmanager=dataclasses.replace(AlertmanagerConfig(), urls=urls, **am)
    )


def xid_finding(code: int = 79, gpu: dict[str, str] = GPU0, since: float = 0.0) -> Finding:
    return Finding(
        rule="xid",
        alertname="GpuXidCritical",
        scope="gpu",
        subject=labels_of(gpu),
        severity=Severity.CRITICAL,
        reason=f"Xid {code} (GPU has fallen off the bus)",
        action=Action.REBOOT_NODE,
        remediation="Drain the node and reboot it; reseat the GPU if it repeats.",
        labels=(("xid", str(code)), ("name", "GPU has fallen off the bus")),
        since=since or time.time(),
    )


def ecc_finding(gpu: dict[str, str] = GPU1) -> Finding:
    return Finding(
        rule="ecc",
        alertname="GpuEccUncorrectable",
        scope="gpu",
        subject=labels_of(gpu),
        severity=Severity.CRITICAL,
        reason="volatile uncorrected ECC errors rose from 0 to 2",
        action=Action.RESET_GPU,
        remediation="Drain and reset the GPU.",
        since=time.time(),
    )


def wait_for(pred: Any, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return bool(pred())


def parse_ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def unique_node() -> str:
    return f"node-{uuid.uuid4().hex[:8]}"


def test_fire_shows_in_alertmanager_then_resolves(am: AlertmanagerServer, tmp_path: Path) -> None:
    node = unique_node()
    cfg = config(
        [am.url],
        runbook_base_url="https://runbooks.example/gpuwatchd/",
        static_labels={"cluster": "c1", "rack": "r7"},
    )
    sink = AlertSink(cfg, str(tmp_path / "gpuwatchd.db"), SystemClock(), node, listen_port=10370)
    f = xid_finding()
    sink.update([f])
    assert sink.flush()
    [alert] = am.alerts(node=node)
    assert alert["labels"] == {
        "alertname": "GpuXidCritical",
        "severity": "critical",
        "node": node,
        "xid": "79",
        "cluster": "c1",
        "rack": "r7",
        **GPU0,
    }
    ann = alert["annotations"]
    assert ann["remediation"] == f.remediation
    assert ann["action"] == "reboot_node"
    assert ann["summary"] == "Critical Xid 79 on GPU 0"
    # the texts the Prometheus rule sends too (gpuwatchd_xid_alert_info)
    assert (
        ann["description"]
        == f"Xid 79 (GPU has fallen off the bus) on GPU 0 ({GPU0['pci_bus_id']})."
    )
    assert ann["runbook_url"] == "https://runbooks.example/gpuwatchd/GpuXidCritical.md"
    assert alert["generatorURL"] == f"http://{node}:10370/alerts"
    assert abs(parse_ts(alert["startsAt"]) - f.since) < 0.01
    # endsAt = now + 4 x max(poll interval 10 s, resend interval 60 s)
    assert 230 < parse_ts(alert["endsAt"]) - time.time() <= 240

    sink.update([])
    assert sink.flush()
    assert am.alerts(node=node) == []
    status = sink.status()
    [kept] = status["alerts"]  # type: ignore[misc]
    assert kept["status"] == "resolved" and kept["delivered"] == {am.url: True}
    sink.stop()


def test_background_sender_delivers_and_counts(am: AlertmanagerServer, tmp_path: Path) -> None:
    node = unique_node()
    sink = AlertSink(config([am.url]), str(tmp_path / "db"), SystemClock(), node)
    sink.start()
    try:
        sink.update([xid_finding(), ecc_finding()])
        assert wait_for(lambda: len(am.alerts(node=node)) == 2)
        assert wait_for(lambda: _metric(sink, "gpuwatchd_alertmanager_queue_length") == 0)
        assert _metric(sink, "gpuwatchd_alerts_firing", severity="critical") == 2
        assert _metric(sink, "gpuwatchd_alertmanager_notifications_total", result="success") >= 1
    finally:
        sink.stop()


def test_outage_then_every_alert_arrives(tmp_path: Path) -> None:
    server = AlertmanagerServer(tmp_path / "am")
    server.start()
    node = unique_node()
    cfg = config([server.url], resend_interval=1.0, retry_max_seconds=1.0, timeout=2.0)
    sink = AlertSink(cfg, str(tmp_path / "db"), SystemClock(), node)
    sink.start()
    try:
        server.stop()
        a, b = xid_finding(gpu=GPU0), ecc_finding(gpu=GPU1)
        sink.update([a, b])
        time.sleep(1.0)
        sink.update([b])  # a fired and resolved while Alertmanager was away
        assert wait_for(
            lambda: (
                _metric(sink, "gpuwatchd_alertmanager_notifications_total", result="failure") >= 2
            )
        )
        assert _metric(sink, "gpuwatchd_alertmanager_queue_length") == 2
        server.start()
        assert wait_for(lambda: len(server.alerts(node=node)) == 1)
        [firing] = server.alerts(node=node)
        assert firing["labels"]["alertname"] == "GpuEccUncorrectable"  # type: ignore[index]
        # The resolved one arrived too (Alertmanager does not list resolved alerts).
        assert wait_for(
            lambda: server.metric("alertmanager_alerts_received_total", status="resolved") >= 1
        )
        assert wait_for(lambda: _metric(sink, "gpuwatchd_alertmanager_queue_length") == 0)
        assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total") == 0
    finally:
        sink.stop()
        server.stop()


def test_restart_neither_duplicates_nor_loses(am: AlertmanagerServer, tmp_path: Path) -> None:
    node = unique_node()
    db = str(tmp_path / "gpuwatchd.db")
    first = AlertSink(config([am.url]), db, SystemClock(), node)
    a = xid_finding(since=time.time() - 100)
    first.update([a])
    assert first.flush()
    [before] = am.alerts(node=node)
    # A second alert fires and the daemon dies before it is sent (no flush, no stop).
    first.update([a, ecc_finding()])
    first._outbox.close()

    second = AlertSink(config([am.url]), db, SystemClock(), node)
    assert second.flush()  # what was queued goes out before any new evaluation
    assert {x["labels"]["alertname"] for x in am.alerts(node=node)} == {  # type: ignore[index]
        "GpuXidCritical",
        "GpuEccUncorrectable",
    }
    # The restarted engine sees the same conditions with a later `since`.
    second.update([xid_finding(since=time.time()), ecc_finding()])
    assert second.flush()
    after = {x["labels"]["alertname"]: x for x in am.alerts(node=node)}  # type: ignore[index]
    assert len(after) == 2
    assert after["GpuXidCritical"]["startsAt"] == before["startsAt"]
    assert abs(parse_ts(str(before["startsAt"])) - a.since) < 0.01
    assert len(second.status()["alerts"]) == 2  # type: ignore[arg-type]
    second.stop()


def test_batches_of_at_most_256(am: AlertmanagerServer, tmp_path: Path) -> None:
    node = unique_node()
    sink = AlertSink(config([am.url]), str(tmp_path / "db"), SystemClock(), node)
    many = [xid_finding(code=i) for i in range(300)]
    sink.update(many)
    assert sink.flush()
    assert len(am.alerts(node=node)) == 300
    assert _metric(sink, "gpuwatchd_alertmanager_notifications_total", result="success") == 2
    sink.stop()


def test_invalid_labels_are_dropped_not_sent(am: AlertmanagerServer, tmp_path: Path) -> None:
    node = unique_node()
    sink = AlertSink(config([am.url]), str(tmp_path / "db"), SystemClock(), node)
    bad = dataclasses.replace(xid_finding(), subject=labels_of({**GPU0, "gpu": "0\udcff"}))
    odd_text = dataclasses.replace(ecc_finding(), reason="from a log line: \udcff")
    sink.update([bad, odd_text])
    assert sink.flush()
    [sent] = am.alerts(node=node)
    assert sent["labels"]["alertname"] == "GpuEccUncorrectable"  # type: ignore[index]
    assert sent["annotations"]["description"] == "from a log line: ?"  # type: ignore[index]
    assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total", reason="invalid") == 1
    sink.stop()


def test_queue_bound_drops_and_counts(tmp_path: Path) -> None:
    sink = AlertSink(config([], max_alerts=10), str(tmp_path / "db"), SystemClock(), "n")
    sink.update([xid_finding(code=i) for i in range(12)])
    # Two wait outside the full outbox (sent when room frees); none is dropped yet.
    assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total", reason="queue_full") == 0
    assert _metric(sink, "gpuwatchd_alerts_firing", severity="critical") == 10
    code, ctype, body = sink.route_alerts({"state": ["firing"]})
    assert code == 200 and ctype == "application/json"
    assert len(json.loads(body)["alerts"]) == 10
    sink.update([xid_finding(code=i) for i in range(10)])  # the two ended while waiting
    assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total", reason="queue_full") == 2
    sink.stop()


class _Rejecting(http.server.BaseHTTPRequestHandler):
    posts: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts.append(body)
        text = b"bad alert: GpuXidCritical" if b"GpuXidCritical" in body else b""
        self.send_response(400 if text else 200)
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args: Any) -> None:
        pass


def test_non_2xx_body_is_logged_and_only_the_bad_alert_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Rejecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sink = AlertSink(config([url]), str(tmp_path / "db"), SystemClock(), "n")
    try:
        with caplog.at_level(logging.ERROR, "gpuwatchd.alertmanager"):
            sink.update([xid_finding(), ecc_finding()])
            assert sink.flush()
        assert "answered 400: bad alert: GpuXidCritical" in caplog.text
        assert len(_Rejecting.posts) == 3  # the batch, then each alert alone
        assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total", reason="rejected") == 1
    finally:
        sink.stop()
        server.shutdown()
        server.server_close()


def test_tls_and_basic_auth(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    bcrypt = pytest.importorskip("bcrypt")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {tmp_path / 'server.pem'}\n"
        f"  key_file: {tmp_path / 'server.pem'}\n"
        f"basic_auth_users:\n  gpuwatchd: '{hashed}'\n"
    )
    (tmp_path / "password").write_text("s3cret\n")
    server = AlertmanagerServer(tmp_path / "am", web_config=str(web), scheme="https")
    server.start()
    try:
        node = unique_node()
        cfg = config(
            [server.url],
            tls_ca_file=str(tmp_path / "ca.pem"),
            basic_auth_user="gpuwatchd",
            basic_auth_password_file=str(tmp_path / "password"),
        )
        sink = AlertSink(cfg, str(tmp_path / "db"), SystemClock(), node)
        sink.update([xid_finding()])
        assert sink.flush()
        sink.stop()
        (tmp_path / "password").write_text("wrong\n")
        sink = AlertSink(cfg, str(tmp_path / "db2"), SystemClock(), node)
        sink.update([ecc_finding()])
        assert not sink.flush()
        assert _metric(sink, "gpuwatchd_alertmanager_notifications_total", result="failure") == 1
        # A 401 is our configuration's fault: the alert stays queued, nothing is dropped.
        assert _metric(sink, "gpuwatchd_alertmanager_queue_length") == 1
        assert _metric(sink, "gpuwatchd_alertmanager_dropped_alerts_total") == 0
        sink.stop(flush_timeout=0.5)
    finally:
        server.stop()


def test_validate_config_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"alertmanager.urls\[0\]"):
        validate_config(config(["am:9093"]))
    with pytest.raises(ConfigError, match="reserved"):
        validate_config(config([], static_labels={"node": "x"}))
    with pytest.raises(ConfigError, match="cannot read"):
        validate_config(config([], bearer_token_file=str(tmp_path / "missing")))
    validate_config(config([f"http://127.0.0.1:{free_port()}"], static_labels={"rack": "r1"}))


def _metric(sink: AlertSink, name: str, **labels: str) -> float:
    total = 0.0
    for s in sink.samples():
        if s.name == name and all(s.label(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_alert_labels_keep_only_declared_labels() -> None:
    from gpuwatchd.sinks.alertmanager.sink import alert_labels

    port = Finding(
        rule="ib",
        alertname="InfinibandPortDown",
        scope="port",
        subject=(("device", "mlx5_0"), ("port", "1")),
        severity=Severity.CRITICAL,
        reason="down",
        labels=(("gpus", "0,1"),),
    )
    assert alert_labels(port, "n1", {"cluster": "c"}) == {
        "alertname": "InfinibandPortDown",
        "severity": "critical",
        "node": "n1",
        "device": "mlx5_0",
        "port": "1",
        "cluster": "c",
    }
    shm = Finding(
        rule="shm",
        alertname="ShmNearlyFull",
        scope="node",
        subject=(("path", "/dev/shm"),),
        severity=Severity.WARNING,
        reason="full",
    )
    assert alert_labels(shm, "n1", {}) == {
        "alertname": "ShmNearlyFull",
        "severity": "warning",
        "node": "n1",
    }


def test_real_xid_line_to_alertmanager_and_operator_clear(
    am: AlertmanagerServer, tmp_path: Path
) -> None:
    """kernel log line -> Xid pipeline -> health engine -> sink -> Alertmanager, and back."""
    from gpuwatchd import config as configmod
    from gpuwatchd.health.engine import HealthEngine
    from gpuwatchd.health.xid.stage import XidStage
    from gpuwatchd.model import Clear
    from gpuwatchd.sources import SourceContext
    from gpuwatchd.sources.kmsg.source import KmsgSource
    from gpuwatchd.sources.nvml.source import NvmlSource
    from gpuwatchd.sources.runner import Runner

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    boot = tmp_path / "boot_id"
    boot.write_text("5d1e0c8a-0b6f-4d8e-9a39-2f6a3c1b7e21\n")
    cfg = configmod.load_text(
        f"daemon: {{state_dir: {tmp_path}}}\n"
        f"paths: {{boot_id: {boot}}}\n"
        f"sources:\n  nvml: {{replay: {fixtures / 'nvml' / 'h200x2-probe.json'}}}\n"
        f"  kmsg: {{backend: file, file: {fixtures / 'kmsg' / 'h200-xid31-kmsg.txt'}}}\n"
        "xid: {overrides: {'31': {severity: critical, action: reset_gpu}}}\n"
        f"alertmanager: {{urls: ['{am.url}']}}\n"
    )
    node, clock, state = unique_node(), SystemClock(), State()
    pipeline = XidStage.from_config(cfg, state.publish_extra, None, clock)
    sink = AlertSink(cfg, str(tmp_path / "gpuwatchd.db"), clock, node)
    engine = HealthEngine(cfg, clock, state, xids=pipeline.conditions)
    engine.add_listener(sink.update)
    state.subscribe(pipeline.on_publish)  # the pipeline first: it tracks what the engine reads
    state.subscribe(engine.on_publish)

    def gpus() -> GpuInventory:
        nvml = state.snapshot().sources.get("nvml")
        return nvml.inventory if nvml and nvml.inventory else GpuInventory()

    ctx = SourceContext(clock=clock, gpus=gpus)
    runner = Runner(
        [NvmlSource.from_config(cfg, ctx), KmsgSource.from_config(cfg, ctx)], state, clock
    )
    try:
        runner.poll_once("nvml")
        runner.poll_once("kmsg")
        assert sink.flush()
        [alert] = am.alerts(node=node)
        assert alert["labels"] == {
            "alertname": "GpuXidCritical",
            "severity": "critical",
            "node": node,
            "xid": "31",
            "incident": f"xid-{GPU0['pci_bus_id']}-31",  # shared with a hang it caused
            **GPU0,
        }
        ann = alert["annotations"]
        assert ann["remediation"].startswith("A process accessed a GPU virtual address")
        assert ann["action"] == "reset_gpu"
        assert "Reported by pid 650 python3." in ann["description"]

        pipeline.clear("alice", pci_bus_id=GPU0["pci_bus_id"], reason="job fixed")
        engine.apply_clear(
            Clear(
                id=1,
                time=time.time(),
                pci_bus_id=GPU0["pci_bus_id"],
                who="alice",
                reason="job fixed",
            )
        )
        assert sink.flush()
        assert am.alerts(node=node) == []
    finally:
        runner.stop()
        sink.stop()


def test_stop_is_bounded_when_alertmanager_hangs(tmp_path: Path) -> None:
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections in the kernel, never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    sink = AlertSink(config([url], timeout=3.0), str(tmp_path / "db"), SystemClock(), "n")
    sink.start()
    sink.update([xid_finding()])
    started = time.monotonic()
    sink.stop(flush_timeout=1.0)
    assert time.monotonic() - started < 3.0
    silent.close()
    again = AlertSink(config([url]), str(tmp_path / "db"), SystemClock(), "n")
    assert again._outbox.undelivered([url]) == 1  # kept for the next start
    again._outbox.close()
    time.sleep(2.5)  # the POST in flight at stop() times out; its thread must end quietly
