"""The Kubernetes actions through the official client, over real HTTP to a local
server that answers like the API server's Node endpoints.

No kube-apiserver can be installed from the package registries this project
uses (Debian has none; PyPI and npm have clients only), so the server here
serves a Node object in the v1 API's shape (tests/fixtures/kubernetes/node.json)
and applies the strategic merge the API server would: conditions merged by
type, the taint list replaced as a whole. The client's real requests (path,
method, content type, bearer token, body) are what the tests check.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from gpuwatchd import config  # noqa: E402
from gpuwatchd.cli import main  # noqa: E402
from gpuwatchd.clock import FakeClock  # noqa: E402
from gpuwatchd.config import Config  # noqa: E402
from gpuwatchd.diag.run import FAKE_WORKER_ENV  # noqa: E402
from gpuwatchd.errors import GpuwatchdError  # noqa: E402
from gpuwatchd.model import Finding, Severity, labels_of  # noqa: E402
from gpuwatchd.sinks.remediation.kubernetes import TAINT_KEY, KubernetesNode  # noqa: E402
from gpuwatchd.sinks.remediation.sink import RemediationSink  # noqa: E402
from gpuwatchd.sinks.store import EventStore  # noqa: E402
from tests.diag.fakes import H100_IDLE, HEALTHY_H100_STANDARD, canned  # noqa: E402

NODE = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes" / "node.json").read_text()
)
NAME = NODE["metadata"]["name"]
T0 = 1_700_000_000.0


class FakeApiServer:
    """Loopback HTTP server with the Node GET/PATCH endpoints; keeps every request."""

    def __init__(self, fail_status: int = 0) -> None:
        self.node: dict[str, Any] = copy.deepcopy(NODE)
        self.requests: list[dict[str, Any]] = []
        self.fail_status = fail_status
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n)) if n else None
                req = {
                    "method": self.command,
                    "path": self.path.split("?")[0],
                    "content_type": self.headers.get("Content-Type", ""),
                    "authorization": self.headers.get("Authorization", ""),
                    "body": body,
                }
                api.requests.append(req)
                return req

            def do_GET(self) -> None:
                req = self._record()
                if req["path"] != f"/api/v1/nodes/{NAME}":
                    return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                self._answer(200, api.node)

            def do_PATCH(self) -> None:
                req = self._record()
                if api.fail_status:
                    return self._answer(
                        api.fail_status,
                        {"kind": "Status", "code": api.fail_status, "reason": "Forbidden"},
                    )
                if req["path"] == f"/api/v1/nodes/{NAME}/status":
                    conds = api.node["status"]["conditions"]
                    for c in req["body"]["status"]["conditions"]:
                        conds[:] = [x for x in conds if x["type"] != c["type"]] + [c]
                elif req["path"] == f"/api/v1/nodes/{NAME}":
                    api.node["spec"]["taints"] = req["body"]["spec"]["taints"]
                else:
                    return self._answer(404, {"kind": "Status", "code": 404})
                self._answer(200, api.node)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def condition(self) -> dict[str, Any]:
        [c] = [c for c in self.node["status"]["conditions"] if c["type"] == "GpuHealthy"]
        return dict(c)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def make_cfg(tmp_path: Path, url: str, taint: bool = True, extra: str = "") -> Config:
    token = tmp_path / "token"
    token.write_text("sa-token-123\n")
    path = tmp_path / "config.yaml"
    path.write_text(
        f"""
daemon: {{state_dir: {tmp_path / "state"}, node_name: {NAME}}}
remediation:
  hold_seconds: 60
  kubernetes: {{condition_on: [critical], taint_on: {"[critical]" if taint else "[]"},
               api_url: "{url}", token_file: {token}, timeout: 5{extra}}}
"""
    )
    return config.load(str(path))


def lost() -> Finding:
    return Finding(
        "gpu_lost", "GpuLost", "gpu", labels_of({"gpu": "5"}), Severity.CRITICAL,
        "GPU 5 is no longer listed by NVML", remediation="Drain and reboot the node.", since=T0,
    )  # fmt: skip


def test_condition_and_taint_written_then_resumed(
    api: FakeApiServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = make_cfg(tmp_path, api.url)
    store = EventStore.from_config(cfg)
    sink = RemediationSink(cfg, FakeClock(T0), NAME, store)
    try:
        sink.update([lost()])
        assert sink.step(T0 + 59) == []
        assert api.requests == []
        actions = [d.action for d in sink.step(T0 + 60)]
        assert actions == ["kubernetes_condition", "kubernetes_taint"]
    finally:
        store.close()

    status = [r for r in api.requests if r["path"].endswith("/status")]
    assert status[0]["method"] == "PATCH"
    assert status[0]["content_type"] == "application/strategic-merge-patch+json"
    assert status[0]["authorization"] == "Bearer sa-token-123"
    cond = api.condition()
    assert cond["status"] == "False" and cond["reason"] == "GpuLost"
    assert cond["message"].startswith("gpuwatchd: GpuLost gpu 5: Drain and reboot")
    # kubelet's conditions are untouched.
    assert {c["type"] for c in api.node["status"]["conditions"]} == {
        "MemoryPressure",
        "Ready",
        "GpuHealthy",
    }
    # The taint is added beside the existing one, after reading the node.
    methods = [(r["method"], r["path"]) for r in api.requests if not r["path"].endswith("/status")]
    assert methods == [("GET", f"/api/v1/nodes/{NAME}"), ("PATCH", f"/api/v1/nodes/{NAME}")]
    assert api.node["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": TAINT_KEY, "value": "GpuLost", "effect": "NoSchedule"},
    ]

    # GpuHealthy=True only after diag standard passes (a replayed H100, canned results).
    conf = tmp_path / "config.yaml"
    conf.write_text(conf.read_text() + f"sources: {{nvml: {{replay: {H100_IDLE}}}}}\n")
    monkeypatch.setenv(FAKE_WORKER_ENV, canned(tmp_path, HEALTHY_H100_STANDARD))
    assert main(["clear", "--resume", "--config", str(conf)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: diag standard")
    assert "GpuHealthy=True" in out and "taint removed" in out
    assert api.condition()["status"] == "True"
    assert api.condition()["reason"] == "OperatorResumed"
    assert api.node["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    ]


def test_api_refusal_is_counted_and_retried_later(tmp_path: Path) -> None:
    api = FakeApiServer(fail_status=403)
    try:
        cfg = make_cfg(tmp_path, api.url, taint=False)
        store = EventStore.from_config(cfg)
        sink = RemediationSink(cfg, FakeClock(T0), NAME, store)
        sink.update([lost()])
        assert [d.action for d in sink.step(T0 + 60)] == ["kubernetes_condition"]
        rows = store.recent(5, kind="remediation")
        assert rows[0]["attrs"]["result"] == "failed"
        assert "HTTP 403" in rows[0]["message"]
        assert sink.step(T0 + 61) == []  # backs off
        assert [d.action for d in sink.step(T0 + 121)] == ["kubernetes_condition"]
        samples = {(s.name, s.labels): s.value for s in sink.samples()}
        key = (
            "gpuwatchd_remediation_actions_total",
            (("action", "kubernetes_condition"), ("result", "failed")),
        )
        assert samples[key] == 2
        store.close()
    finally:
        api.close()


def test_unreachable_api_is_bounded(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, "http://127.0.0.1:9", taint=False)
    with pytest.raises(GpuwatchdError, match="patching status of node"):
        KubernetesNode(cfg, NAME).set_condition(False, "GpuLost", "x")


def test_problem_condition_for_tools_that_act_on_true(api: FakeApiServer, tmp_path: Path) -> None:
    """draino cordons on conditions that are True: GpuProblem=True mirrors GpuHealthy=False."""
    cfg = make_cfg(tmp_path, api.url, taint=False, extra=", problem_condition: GpuProblem")
    node = KubernetesNode(cfg, NAME)
    node.set_condition(False, "GpuLost", "gpuwatchd: GpuLost gpu 5")
    types = {c["type"]: c["status"] for c in api.node["status"]["conditions"]}
    assert types["GpuHealthy"] == "False" and types["GpuProblem"] == "True"
    node.set_condition(True, "OperatorResumed", "resumed")
    types = {c["type"]: c["status"] for c in api.node["status"]["conditions"]}
    assert types["GpuHealthy"] == "True" and types["GpuProblem"] == "False"


def test_missing_client_is_said_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib.util

    cfg = make_cfg(tmp_path, "http://127.0.0.1:9", taint=False)
    store = EventStore.from_config(cfg)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kubernetes" else real(name)
    )
    sink = RemediationSink(cfg, FakeClock(T0), NAME, store)
    try:
        sink.start()
        assert "kubernetes Python client is not installed" in caplog.text
    finally:
        sink.stop()
        store.close()
