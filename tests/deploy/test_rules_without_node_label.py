"""The Prometheus rules without the `node` relabelling: they fall back to `instance`.

A real Prometheus scrapes one replaying daemon (a real H200 capture and a
kernel log with a real Xid 31 and SXid lines) through a plain static scrape
config with no labels and no relabelling, under two addresses, so there
are two targets that differ only in `instance`. Every rule must come out
with a `node` label taken from `instance` (without the port), one series
per target, never one that merges both or has no node at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_dashboards import RULES, result, rule_entries, start_replay_daemon
from tests.servers import PrometheusServer

TARGETS = ("127.0.0.1", "localhost")
pytestmark = pytest.mark.slow  # a daemon and a Prometheus per worker: about 12 s


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    tmp = tmp_path_factory.mktemp("rules-no-node")
    daemon = start_replay_daemon(tmp)
    targets = ", ".join(f'"{host}:{daemon.port}"' for host in TARGETS)
    prom_config = f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [{RULES}]
scrape_configs:
  - job_name: gpuwatchd
    static_configs:
      - targets: [{targets}]
"""
    server = PrometheusServer(tmp / "prometheus", prom_config)
    try:
        server.start()
        server.wait_for("count_over_time(gpuwatchd_build_info[1m]) >= 6", timeout=60)
        server.wait_for("count(gpuwatchd:node_health:max) == 2", timeout=30)
        yield server
    finally:
        server.stop()
        daemon.stop()


def nodes(rows: list[Any]) -> list[str]:
    return sorted(str(r["metric"].get("node", "")) for r in rows)


def test_scrape_has_no_node_label(prometheus: PrometheusServer) -> None:
    rows = result(prometheus, "gpuwatchd_build_info")
    assert len(rows) == 2 and all("node" not in r["metric"] for r in rows)


def test_every_rule_names_the_node_from_instance(prometheus: PrometheusServer) -> None:
    problems = []
    for name, rule in rule_entries():
        for row in result(prometheus, rule["expr"]):
            if row["metric"].get("node", "") not in TARGETS:
                problems.append(f"{name}: {row['metric']}")
    assert problems == []


@pytest.mark.parametrize("record", ["gpuwatchd:node_health:max", "gpuwatchd:gpus_unhealthy:count"])
def test_node_level_records_keep_targets_apart(prometheus: PrometheusServer, record: str) -> None:
    assert nodes(result(prometheus, record)) == sorted(TARGETS)


def test_xid_alert_fires_once_per_node(prometheus: PrometheusServer) -> None:
    # The kernel log holds an Xid 31 (warning); its SXid is informational.
    rows = result(prometheus, dict(rule_entries())["GpuXidWarning"]["expr"])
    assert nodes(rows) == sorted(TARGETS), rows
    for row in rows:  # the daemon's label set: no instance, no helper label
        assert set(row["metric"]) == {"node", "gpu", "uuid", "pci_bus_id", "xid", "incident"}


def test_node_label_when_present_wins(prometheus: PrometheusServer) -> None:
    # As if relabelled: the same rule over series that carry node="gpu-node-7".
    expr = dict(rule_entries())["gpuwatchd:node_health:max"]["expr"]
    selector = 'gpuwatchd_health{scope="node"}'
    assert selector in expr
    relabelled = expr.replace(selector, f'label_replace({selector}, "node", "gpu-node-7", "", "")')
    assert nodes(result(prometheus, relabelled)) == ["gpu-node-7"]
