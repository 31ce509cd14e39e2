"""The chart's defaults catch an Xid: the daemon run the way the DaemonSet runs it.

Without a cluster, the rendered manifest is reproduced as far as a process
can: the ConfigMap's config.yaml, the container's args and environment, and
every volume mount resolved to what it names on this machine (hostPath
volumes are the real host paths). Two mounts get stand-ins: /dev/kmsg is a
file in the kernel's record format (a test must not write into the real
kernel log), and the state hostPath is a temporary directory. The listen
port is the one thing changed, so tests can run side by side.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from gpuwatchd import config
from tests.conftest import ROOT, free_port, http_get
from tests.deploy.test_helm_chart import container, daemonset, kind, objects

XID_79 = (
    "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
)


def mounts(ds: dict[str, Any], standins: dict[str, Path]) -> dict[str, str]:
    """Container path -> path on this machine, for every volume mount."""
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    out: dict[str, str] = {}
    for m in spec["containers"][0]["volumeMounts"]:
        name = m["name"]
        if name in standins:
            out[m["mountPath"]] = str(standins[name])
        elif "hostPath" in volumes[name]:
            out[m["mountPath"]] = volumes[name]["hostPath"]["path"]
    return out


def resolve(value: Any, table: dict[str, str]) -> Any:
    """Every string naming a container path, rewritten to the path it is mounted from."""
    if isinstance(value, dict):
        return {k: resolve(v, table) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, table) for v in value]
    if isinstance(value, str):
        for inside in sorted(table, key=len, reverse=True):
            if value == inside or value.startswith(inside.rstrip("/") + "/"):
                return table[inside] + value[len(inside) :]
    return value


def test_default_chart_catches_an_xid_written_to_the_kernel_log(tmp_path: Path) -> None:
    objs = objects({})
    ds = daemonset({})
    c = container({})
    (cm,) = [o for o in kind(objs, "ConfigMap") if "config.yaml" in o["data"]]

    # What the defaults ask of the node: /dev/kmsg read-only with CAP_SYSLOG, and
    # the journal mounted as the fallback; the config says auto (kmsg, then journal).
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    vm = {m["name"]: m for m in c["volumeMounts"]}
    assert vm["kmsg"]["mountPath"] == "/dev/kmsg" and vm["kmsg"]["readOnly"] is True
    assert {"var-log", "journal-run", "machine-id"} <= set(vm)
    rendered = yaml.safe_load(cm["data"]["config.yaml"])
    assert rendered["sources"]["kmsg"] == {"enabled": True, "backend": "auto"}

    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,1000,-;Linux version 6.8.0 (builder@example)\n")
    standins = {"kmsg": kmsg, "state": tmp_path / "state", "tmp": tmp_path / "tmp"}
    for d in ("state", "tmp"):
        standins[d].mkdir()
    table = mounts(ds, standins)
    # The full config the daemon sees: its defaults with the ConfigMap over them.
    full = yaml.safe_load(
        subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "config", "default"],
            capture_output=True, text=True, check=True, cwd=ROOT, timeout=60,
        ).stdout
    )  # fmt: skip
    for section, values in rendered.items():
        for key, value in values.items():
            if isinstance(value, dict):
                full[section][key].update(value)
            else:
                full[section][key] = value
    # the workloads source finds the kubelet's socket where the chart mounts it
    pod_resources = vm["pod-resources"]
    assert pod_resources["readOnly"] is True
    socket_dir = str(Path(full["sources"]["workloads"]["kubelet_socket"]).parent)
    assert socket_dir == pod_resources["mountPath"]
    port = free_port()
    full["http"]["listen"] = f"127.0.0.1:{port}"
    local = resolve(full, table)
    assert local["paths"]["kmsg"] == str(kmsg)
    assert local["daemon"]["state_dir"] == str(standins["state"])
    assert local["paths"]["sysfs"] == "/sys" and local["paths"]["procfs"] == "/proc"
    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump(local))
    config.load(str(conf))  # the loader accepts it as the daemon will

    args = [a if a != "/etc/gpuwatchd/config.yaml" else str(conf) for a in c["args"]]
    assert args == ["run", "--config", str(conf)]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env["GPUWATCHD_NODE_NAME"] = "gpu-node-01"  # the downward API's spec.nodeName
    log = (tmp_path / "daemon.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", *args],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = wait_for(url, r'gpuwatchd_kmsg_reader_up\{backend="kmsg"\} 1', proc, log)
        before = xid_count(body)
        with kmsg.open("a") as f:
            f.write(f"3,2,5000000,-;{XID_79}\n")
        body = wait_for(url, r'gpuwatchd_kmsg_reports_total\{kind="xid"\} 1', proc, log)
        assert xid_count(body) == before + 1, body
        assert re.search(r'gpuwatchd_xid_errors_total\{[^}]*xid="79"[^}]*\} 1', body), body
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def xid_count(body: str) -> float:
    found = re.findall(r'gpuwatchd_kmsg_reports_total\{kind="xid"\} (\S+)', body)
    return float(found[0]) if found else 0.0


def wait_for(url: str, pattern: str, proc: subprocess.Popen[bytes], log: Any) -> str:
    end = time.monotonic() + 45
    body = ""
    while time.monotonic() < end:
        assert proc.poll() is None, _output(log)
        try:
            status, data = http_get(url)
        except OSError:
            status, data = 0, b""
        body = data.decode()
        if status == 200 and re.search(pattern, body):
            return body
        time.sleep(0.2)
    raise AssertionError(f"no {pattern} in {url}:\n{body}\n--- daemon ---\n{_output(log)}")


def _output(log: Any) -> str:
    log.flush()
    log.seek(0)
    return str(log.read())
