"""Every Grafana panel query and every rule expression, run by a real Prometheus.

A real daemon replays a real H200 capture (NVML), follows a kernel log
holding real Xid and SXid lines, watches a /dev/shm directory and the
InfiniBand sysfs fixtures; a real Prometheus scrapes it every second and
loads deploy/prometheus/gpuwatchd-rules.yaml. Then, with the dashboards'
template variables substituted:

- each panel target must parse and return data, and every metric and label
  name it selects must be declared in a METRICS table;
- each variable query must return values;
- each rule must load and evaluate without error, recording rules must
  return data, and every metric and label name an alert selects must be
  declared (an alert's full expression is empty while nothing is wrong).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import FIXTURES, ROOT, DaemonProcess
from tests.servers import PrometheusServer

DASHBOARDS = ROOT / "deploy" / "grafana"
RULES = ROOT / "deploy" / "prometheus" / "gpuwatchd-rules.yaml"
CAPTURE = FIXTURES / "nvml" / "h200x2-probe.json"
CLUSTER, NODE = "e2e", "gpu-node-1"
# What Grafana would put in: the scrape's labels, GPU 0, and windows that hold
# several 1 s scrapes.
VARIABLES = {
    "cluster": CLUSTER,
    "node": NODE,
    "instance": ".*",
    "gpu": "0",
    "datasource": "prometheus",
    "__rate_interval": "15s",
    "__interval": "5s",
    "__range": "5m",
    "__range_s": "300",
}
SELECTOR = re.compile(r"\b(gpuwatchd_[A-Za-z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    values = VARIABLES if values is None else values

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise AssertionError(f"unknown template variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panel_targets() -> list[tuple[str, str, str, str]]:
    """(dashboard, panel title, refId, expr) for every query in every panel."""
    out = []
    for name, dash in load_dashboards().items():
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                out.append((name, panel["title"], t["refId"], t["expr"]))
    return out


def empty_when_healthy() -> set[tuple[str, str]]:
    """Panels that show problems only (jobs hit, hangs): their queries must evaluate."""
    return {
        (name, p["title"])
        for name, dash in load_dashboards().items()
        for p in dash["panels"]
        if p.get("description", "").startswith("Empty while")
    }


def variable_queries() -> list[tuple[str, str, str]]:
    out = []
    for name, dash in load_dashboards().items():
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                out.append((name, var["name"], var["query"]["query"]))
    return out


def rule_entries() -> list[tuple[str, dict[str, Any]]]:
    if not RULES.exists():
        return []
    doc = yaml.safe_load(RULES.read_text())
    return [
        (r.get("alert") or r.get("record"), r) for g in doc.get("groups", []) for r in g["rules"]
    ]


# --- the running system ---------------------------------------------------------------


def kernel_log() -> str:
    """Real kernel lines: an Xid 31 from the H200 the capture was recorded on, an SXid."""
    h200 = (FIXTURES / "kmsg" / "h200-xid31-kmsg.txt").read_text().splitlines()
    sxid = (FIXTURES / "kmsg" / "dmesg-h100-nvswitch-sxid22013.txt").read_text().splitlines()
    lines = [ln for ln in h200 if ln.startswith("[")]
    lines += [ln for ln in sxid if "SXid" in ln]
    return "\n".join(lines) + "\n"


def start_replay_daemon(tmp: Path) -> DaemonProcess:
    """A daemon replaying the H200 capture, with a kernel log holding real Xid and SXid lines."""
    (tmp / "kern.log").write_text(kernel_log())
    (tmp / "shm").mkdir()
    daemon_config = f"""
paths:
  sysfs: {FIXTURES / "sys"}
  dev_shm: {tmp / "shm"}
sources:
  nvml: {{interval: 1}}
  kmsg: {{backend: file, file: {tmp / "kern.log"}}}
  shm: {{interval: 1}}
  infiniband: {{interval: 1}}
"""
    daemon = DaemonProcess(tmp, daemon_config, ["--nvml-replay", str(CAPTURE)], {})
    try:
        daemon.notify.wait_for("READY=1", timeout=60)
    except AssertionError:
        out = daemon.output()
        daemon.stop()
        raise AssertionError(f"daemon not ready:\n{out}") from None
    return daemon


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    tmp = tmp_path_factory.mktemp("dash-e2e")
    daemon = start_replay_daemon(tmp)
    rule_files = f"rule_files: [{RULES}]\n" if RULES.exists() else ""
    prom_config = f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
{rule_files}
scrape_configs:
  - job_name: gpuwatchd
    static_configs:
      - targets: ["127.0.0.1:{daemon.port}"]
        labels: {{cluster: {CLUSTER}, node: {NODE}}}
  # The same daemon as a plain static target: no node or cluster label.
  - job_name: gpuwatchd-plain
    static_configs:
      - targets: ["localhost:{daemon.port}"]
"""
    server = PrometheusServer(tmp / "prometheus", prom_config)
    try:
        server.start()
        # several scrapes, so rate() and increase() have points to work with
        server.wait_for("count_over_time(gpuwatchd_build_info[1m]) >= 6", timeout=60)
        yield server
    finally:
        server.stop()
        daemon.stop()


def result(prom: PrometheusServer, expr: str) -> list[Any]:
    res = prom.query(expr)
    assert res["status"] == "success", f"{expr}\n-> {res.get('error')}"
    data = res["data"]
    assert isinstance(data, dict)
    return list(data["result"])


TARGET_LABELS = {"cluster", "node", "job", "instance"}


@functools.cache
def declared_metrics() -> dict[str, set[str]]:
    """Every metric name the code declares, with its label names.

    From the producers scripts/gen_metrics_doc.py collects (docs/metrics.md's list).
    """
    path = ROOT / "scripts" / "gen_metrics_doc.py"
    loader = importlib.util.spec_from_file_location("gen_metrics_doc", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return {s.name: set(s.labels) for _producer, s in module.collect()}


def check_names(expr: str) -> list[str]:
    """Metric and label names in `expr` that no METRICS table declares; [] when all do.

    Checked against the declarations, not the replay's data: some metrics are
    absent by design on the recorded GPU (retired pages on an H200).
    """
    declared = declared_metrics()
    problems = []
    for name, matchers in SELECTOR.findall(expr):
        if name not in declared:
            problems.append(f"metric {name} is not declared")
            continue
        for label, _op, _value in MATCHER.findall(matchers or ""):
            if label not in declared[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {label}")
    return problems


def test_name_check_can_fail() -> None:
    assert check_names('gpuwatchd_gpu_power_watts{gpu="0", cluster="x"}') == []
    assert check_names("gpuwatchd_gpu_power_watt") == [
        "metric gpuwatchd_gpu_power_watt is not declared"
    ]
    assert check_names('gpuwatchd_gpu_power_watts{sensor="gpu"}') == [
        "gpuwatchd_gpu_power_watts has no label sensor"
    ]


# --- dashboards -----------------------------------------------------------------------


def test_dashboards_exist_and_are_well_formed() -> None:
    dashboards = load_dashboards()
    assert set(dashboards) == {"gpuwatchd-node", "gpuwatchd-fleet"}
    for name, dash in dashboards.items():
        assert dash["uid"] == name
        names = [v["name"] for v in dash["templating"]["list"]]
        assert names[:3] == ["datasource", "cluster", "node"], name
        if name == "gpuwatchd-node":
            assert "gpu" in names
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for p in dash["panels"]:
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24, p["title"]
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                # every query is scoped to the chosen cluster and node(s)
                assert 'cluster=~"$cluster"' in t["expr"], (p["title"], t["expr"])
                assert 'node=~"$node"' in t["expr"], (p["title"], t["expr"])


def test_node_dashboard_covers_the_issue() -> None:
    exprs = " ".join(t[3] for t in panel_targets() if t[0] == "gpuwatchd-node")
    for metric in (
        "gpuwatchd_health",
        "gpuwatchd_gpu_temperature_threshold_celsius",
        "gpuwatchd_gpu_power_watts",
        "gpuwatchd_gpu_ecc_errors_total",
        "gpuwatchd_gpu_remapped_rows_total",
        "gpuwatchd_nvlink_up",
        "gpuwatchd_gpu_pcie_link_generation",
        "gpuwatchd_xid_errors_total",
        "gpuwatchd_shm_segments",
        "gpuwatchd_infiniband_state_id",
        "gpuwatchd_collector_success",
    ):
        assert metric in exprs or metric.replace("state_id", "port_info") in exprs, metric


@pytest.mark.parametrize(
    ("dashboard", "title", "ref", "expr"),
    panel_targets(),
    ids=[f"{d}:{t}:{r}" for d, t, r, _ in panel_targets()],
)
def test_panel_query_returns_data(
    prometheus: PrometheusServer, dashboard: str, title: str, ref: str, expr: str
) -> None:
    query = substitute(expr)
    assert check_names(query) == []
    rows = result(prometheus, query)
    if (dashboard, title) not in empty_when_healthy():
        assert rows, f"{dashboard} / {title} / {ref}: no data for\n{query}"


@pytest.mark.parametrize(
    ("dashboard", "title", "ref", "expr"),
    panel_targets(),
    ids=[f"{d}:{t}:{r}" for d, t, r, _ in panel_targets()],
)
def test_panel_query_without_node_label(
    prometheus: PrometheusServer, dashboard: str, title: str, ref: str, expr: str
) -> None:
    """No ServiceMonitor relabelling: $cluster and $node are All (.*), $instance picks."""
    port = prometheus_target_port(prometheus)
    plain = {**VARIABLES, "cluster": ".*", "node": ".*", "instance": f"localhost:{port}"}
    query = substitute(expr, plain)
    rows = result(prometheus, query)
    if (dashboard, title) not in empty_when_healthy():
        assert rows, f"{dashboard} / {title} / {ref}: no data without a node label:\n{query}"
    for row in rows:
        assert row["metric"].get("node", "") == "", (title, row)


def prometheus_target_port(prometheus: PrometheusServer) -> str:
    res = result(prometheus, 'up{job="gpuwatchd-plain"}')
    return str(res[0]["metric"]["instance"]).rsplit(":", 1)[1]


@pytest.mark.parametrize(("dashboard", "var", "query"), variable_queries())
def test_variable_query_returns_values(
    prometheus: PrometheusServer, dashboard: str, var: str, query: str
) -> None:
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert m, query
    selector, label = substitute(m.group(1)), m.group(2)
    values = {
        r["metric"].get(label) for r in result(prometheus, f"count by ({label}) ({selector})")
    }
    values.discard(None)
    assert values, f"{dashboard}: ${var} would be empty"


def test_substitution_is_complete() -> None:
    for _, _, _, expr in panel_targets():
        assert "$" not in substitute(expr)
    with pytest.raises(AssertionError, match="unknown template variable"):
        substitute('x{a="$nope"}')


# --- rules ------------------------------------------------------------------------------


def test_rules_file_exists() -> None:
    assert RULES.exists(), "deploy/prometheus/gpuwatchd-rules.yaml is missing"
    assert rule_entries()


@pytest.mark.parametrize(("name", "rule"), rule_entries(), ids=[n for n, _ in rule_entries()])
def test_rule_expression(prometheus: PrometheusServer, name: str, rule: dict[str, Any]) -> None:
    expr = rule["expr"]
    rows = result(prometheus, expr)  # parses and evaluates
    assert check_names(expr) == [], name
    if "record" in rule:
        assert rows, f"recording rule {name} returns no data"


def test_rules_loaded_and_evaluate_cleanly(prometheus: PrometheusServer) -> None:
    if not RULES.exists():
        pytest.fail("deploy/prometheus/gpuwatchd-rules.yaml is missing")
    res = prometheus.api("rules")
    assert res["status"] == "success"
    data = res["data"]
    assert isinstance(data, dict)
    loaded = [r for g in data["groups"] for r in g["rules"]]
    assert len(loaded) == len(rule_entries())
    bad = [(r["name"], r.get("lastError")) for r in loaded if r.get("health") == "err"]
    assert bad == []
