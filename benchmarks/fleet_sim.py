"""Fleet simulation: N gpuwatchd daemons, one Prometheus, one Alertmanager, on loopback.

A benchmark, not a test. Starts N (default 64) daemons, staggered, each
replaying one of the recorded captures (tests/fixtures/nvml: the 1-GPU H100,
the 2-GPU H200, the 8-GPU H200, and the full 8xH200 HGX board of
benchmarks/hgx.py) with its own state directory and kernel log file; one real
Prometheus scrapes them all every 15 s with deploy/prometheus/ rules; one
real Alertmanager runs deploy/alertmanager/alertmanager.yml (group_wait cut
to 10 s so a short run sees the notifications) with its receivers pointed at a
loopback webhook that counts notifications. The daemons also send their own
alerts to that Alertmanager, as in production.

Faults, injected after start-up:
  node-000  an Xid 79 line in its kernel log file, then NVML answers GPU_IS_LOST
  node-001  NVLink CRC errors rising on link 0 of GPU 2 (replay script; the 8-GPU
            capture records link 0's counters)
  node-002  every NVML call of GPU 5 hangs (replay script)

Measured: series per node and in total, Prometheus rule group evaluation
time, fleet dashboard query latency (every panel query, all nodes),
notifications per node incident, memory (RSS) of each daemon.

    .venv/bin/python benchmarks/fleet_sim.py --nodes 64 --seconds 150 --json fleet.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.hgx import hgx_capture, hgx_sysfs  # noqa: E402
from tests.servers import AlertmanagerServer, PrometheusServer, free_port  # noqa: E402

NVML = ROOT / "tests" / "fixtures" / "nvml"
CAPTURES = ("h100-record.json", "h200x2-probe.json", "h200x8-from-h200x2.json", "hgx")
RULES = ROOT / "deploy" / "prometheus" / "gpuwatchd-rules.yaml"
AM_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
FLEET_DASHBOARD = ROOT / "deploy" / "grafana" / "gpuwatchd-fleet.json"
XID79 = (
    "[ 8123.456789] NVRM: Xid (PCI:0000:00:06): 79, pid='<unknown>', name=<unknown>,"
    " GPU has fallen off the bus.\n"
)
SCRAPE = "15s"


class Webhook:
    """Counts Alertmanager notifications per receiver."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with lock:
                    hook.received.append({"receiver": self.path.strip("/"), **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def capture_kind(i: int) -> str:
    """Which capture node i replays (the faulted nodes are 8-GPU H200s)."""
    return CAPTURES[i % len(CAPTURES)] if i > 2 else "h200x8-from-h200x2.json"


def node_capture(i: int, base: Path) -> tuple[Path, Path | None]:
    """Capture (and, for the HGX board, a sysfs root) of node i; faults scripted in."""
    kind = capture_kind(i)
    cap = hgx_capture() if kind == "hgx" else json.loads((NVML / kind).read_text())
    cap = copy.deepcopy(cap)
    script = cap.setdefault("script", [])
    if i == 0:  # follows the kernel's Xid 79: the GPU is gone for NVML too
        script.append({"device": 0, "call": "*", "from_s": 60, "error": "GPU_IS_LOST"})
    elif i == 1:
        script.append(
            {
                "device": 2,
                "call": "NVML_FI_DEV_NVLINK_ERROR_DL_CRC@0",
                "from_s": 45,
                "add_per_poll": 500,
            }
        )
    elif i == 2:
        script.append({"device": 5, "call": "*", "from_s": 45, "hang": True})
    path = base / f"node-{i:03d}.json"
    path.write_text(json.dumps(cap))
    return path, (hgx_sysfs(base / "hgx-sys") if kind == "hgx" else None)


def start_daemon(i: int, base: Path, am_url: str) -> dict[str, Any]:
    node = f"node-{i:03d}"
    work = base / node
    (work / "shm").mkdir(parents=True)
    (work / "kern.log").write_text("")
    capture, sysfs = node_capture(i, base)
    port = free_port()
    cfg = {
        "daemon": {"node_name": node, "state_dir": str(work / "state"), "log_level": "warning"},
        "http": {"listen": f"127.0.0.1:{port}"},
        "paths": {
            "sysfs": str(sysfs or ROOT / "tests" / "fixtures" / "sys"),
            "dev_shm": str(work / "shm"),
        },
        "sources": {
            "nvml": {"replay": str(capture), "interval": 10.0, "nvlink_error_interval": 10.0},
            "kmsg": {"backend": "file", "file": str(work / "kern.log")},
            "udev": {"enabled": False},
        },
        "alertmanager": {"urls": [am_url], "static_labels": {"cluster": "sim"}},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(work / "config.yaml")],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return {"node": node, "port": port, "proc": proc, "work": work, "log": log}


def prometheus_config(daemons: list[dict[str, Any]], am_port: int) -> str:
    targets = [
        {"targets": [f"127.0.0.1:{d['port']}"], "labels": {"node": d["node"]}} for d in daemons
    ]
    cfg = {
        "global": {
            "scrape_interval": SCRAPE,
            "evaluation_interval": SCRAPE,
            "external_labels": {"cluster": "sim"},
        },
        "rule_files": [str(RULES)],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
        },
        "scrape_configs": [{"job_name": "gpuwatchd", "static_configs": targets}],
    }
    return yaml.safe_dump(cfg)


def alertmanager_config(hook: Webhook) -> str:
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    cfg["route"]["group_wait"] = "10s"
    for receiver in cfg["receivers"]:
        for w in receiver.get("webhook_configs", []):
            w["url"] = f"{hook.url}/{receiver['name']}"
    return yaml.safe_dump(cfg)


def prom_metric(prom: PrometheusServer, name: str) -> dict[str, float]:
    """Samples of one of Prometheus' own metrics, by their label text."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        prom.url + "/metrics", timeout=10
    ) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            series, _, value = line.rpartition(" ")
            out[series[len(name) :]] = float(value)
    return out


def query(prom: PrometheusServer, expr: str) -> list[dict[str, Any]]:
    res = prom.query(expr)
    assert res["status"] == "success", (expr, res)
    data = res["data"]
    assert isinstance(data, dict)
    return list(data["result"])


def slowest_rules(prom: PrometheusServer, n: int = 5) -> dict[str, float]:
    """The `n` rules whose last evaluation took longest (seconds), by name."""
    data = prom.api("rules")["data"]
    assert isinstance(data, dict)
    rules = [
        (float(r.get("evaluationTime", 0.0)), r["name"]) for g in data["groups"] for r in g["rules"]
    ]
    return {name: round(t, 4) for t, name in sorted(rules, reverse=True)[:n]}


def dashboard_latency(prom: PrometheusServer, rounds: int = 3) -> dict[str, float]:
    """Seconds each fleet dashboard query takes over all nodes (median of `rounds`)."""
    values = {
        "cluster": ".*",
        "node": ".*",
        "instance": ".*",
        "__range": "1h",
        "__rate_interval": "1m",
        "datasource": "prometheus",
    }
    dash = json.loads(FLEET_DASHBOARD.read_text())
    out: dict[str, float] = {}
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], t["expr"])
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                prom.api("query", query=expr)
                times.append(time.perf_counter() - t0)
            out[f"{panel['title']} {t['refId']}"] = statistics.median(times)
    return out


def notifications(hook: Webhook) -> dict[str, Any]:
    """Firing notifications per node (each receiver counted), and what they were about."""
    per_node: dict[str, list[str]] = {}
    for n in hook.received:
        if n.get("status") != "firing":
            continue
        node = n.get("groupLabels", {}).get("node", "?")
        per_node.setdefault(node, []).append(
            f"{n['receiver']}:{n['groupLabels'].get('alertname')} ({len(n['alerts'])} alerts)"
        )
    return per_node


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=150.0, help="run time after start-up")
    ap.add_argument("--stagger", type=float, default=0.4, help="seconds between daemon starts")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="gpuwatchd-fleet-"))
    hook = Webhook()
    daemons: list[dict[str, Any]] = []
    am = AlertmanagerServer(base / "alertmanager")
    am.config.write_text(alertmanager_config(hook))
    prom: PrometheusServer | None = None
    try:
        am.start()
        t_start = time.monotonic()
        for i in range(args.nodes):
            daemons.append(start_daemon(i, base, am.url))
            time.sleep(args.stagger)
        started = time.monotonic() - t_start
        prom = PrometheusServer(base / "prometheus", prometheus_config(daemons, am.port))
        prom.start(timeout=60)
        fault_at = time.monotonic()
        with open(daemons[0]["work"] / "kern.log", "a") as fh:
            fh.write(XID79)
        end = fault_at + args.seconds
        while time.monotonic() < end:
            time.sleep(5)
        up = query(prom, 'sum(up{job="gpuwatchd"})')
        per_node = {
            r["metric"]["node"]: int(float(r["value"][1]))
            for r in query(prom, 'count by (node) ({__name__=~"gpuwatchd_.+", job="gpuwatchd"})')
        }
        captures = {d["node"]: capture_kind(int(d["node"][5:])) for d in daemons}
        by_capture: dict[str, list[int]] = {}
        for node, n in per_node.items():
            by_capture.setdefault(captures[node], []).append(n)
        rule_times = prom_metric(prom, "prometheus_rule_group_last_duration_seconds")
        head = prom_metric(prom, "prometheus_tsdb_head_series")
        latency = dashboard_latency(prom)
        rules_slowest = slowest_rules(prom)
        rss = [rss_bytes(d["proc"].pid) for d in daemons if d["proc"].poll() is None]
        prom_rss = rss_bytes(prom.proc.pid) if prom.proc is not None else 0
        scrape = [
            float(r["value"][1]) for r in query(prom, 'scrape_duration_seconds{job="gpuwatchd"}')
        ]
        alerts = query(prom, 'ALERTS{alertstate="firing"}')
        fig = {
            "nodes": args.nodes,
            "nodes_up": int(float(up[0]["value"][1])) if up else 0,
            "startup_seconds": round(started, 1),
            "run_seconds_after_fault": args.seconds,
            "series_total_gpuwatchd": sum(per_node.values()),
            "series_prometheus_head": next(iter(head.values()), 0.0),
            "series_per_node_by_capture": {
                k: {"nodes": len(v), "median": statistics.median(v), "max": max(v)}
                for k, v in sorted(by_capture.items())
            },
            "prometheus_rss_mib": round(prom_rss / 2**20, 1),
            "scrape_seconds": {"median": statistics.median(scrape), "max": max(scrape)},
            "rule_group_seconds": {
                k.rsplit(";", 1)[-1].strip('"}'): v for k, v in rule_times.items()
            },
            "slowest_rules_seconds": rules_slowest,
            "dashboard_query_seconds": {
                "median": statistics.median(latency.values()),
                "max": max(latency.values()),
                "slowest": max(latency, key=lambda k: latency[k]),
            },
            "prometheus_alerts_firing": sorted(
                f"{a['metric'].get('node')}:{a['metric']['alertname']}" for a in alerts
            ),
            "notifications_by_node": notifications(hook),
            "notifications_total": sum(1 for n in hook.received if n.get("status") == "firing"),
            "daemon_rss_mib": {
                "median": round(statistics.median(rss) / 2**20, 1),
                "max": round(max(rss) / 2**20, 1),
                "total": round(sum(rss) / 2**20, 1),
            },
        }
        text = json.dumps(fig, indent=1)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return 0
    finally:
        if prom is not None:
            prom.stop()
        for d in daemons:
            d["proc"].terminate()
        for d in daemons:
            try:
                d["proc"].wait(15)
            except subprocess.TimeoutExpired:
                d["proc"].kill()
                d["proc"].wait(5)
            d["log"].close()
        am.stop()
        hook.server.shutdown()
        hook.server.server_close()
        if os.environ.get("FLEET_SIM_KEEP") != "1":
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
