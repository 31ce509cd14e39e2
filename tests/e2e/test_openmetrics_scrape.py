"""A real Prometheus scrapes the daemon, which answers its Accept with OpenMetrics."""

from __future__ import annotations

import urllib.request

import pytest

from tests.e2e.test_exposition_golden import CAPTURE, config
from tests.servers import PrometheusServer

pytestmark = pytest.mark.slow  # a daemon and a Prometheus: about 5 s

# The Accept header Prometheus 2.x sends on every scrape.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_prometheus_scrapes_the_openmetrics_exposition(start_daemon, tmp_path) -> None:
    d = start_daemon(config(tmp_path), "--nvml-replay", str(CAPTURE))
    request = urllib.request.Request(d.url + "/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(request, timeout=10) as resp:
        ctype, body = resp.headers["Content-Type"], resp.read().decode()
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith("# EOF\n")
    samples = sum(1 for ln in body.splitlines() if ln and not ln.startswith("#"))

    prom_config = f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: gpuwatchd
    static_configs:
      - targets: ["127.0.0.1:{d.port}"]
"""
    with PrometheusServer(tmp_path / "prometheus", prom_config) as prom:
        prom.wait_for('up{job="gpuwatchd"} == 1')
        prom.wait_for('gpuwatchd_gpu_temperature_celsius{gpu="1"}')
        prom.wait_for("gpuwatchd_exporter_dropped_samples_total")
        (row,) = prom.wait_for('scrape_samples_scraped{job="gpuwatchd"}')
        # Every sample of the exposition made it in (a few may come or go between scrapes).
        assert abs(float(row["value"][1]) - samples) <= 5, (row, samples)  # type: ignore[index]
        targets = prom.api("targets")["data"]["activeTargets"]  # type: ignore[index]
        assert [t["lastError"] for t in targets] == [""]
