"""The chart's defaults catch an Xid: the daemon run the way the DaemonSet runs it.

Without a cluster, the rendered manifest is reproduced as far as a process
can: the ConfigMap's config.yaml, the container's args and environment, and
every volume mount resolved to what it names on this machine (hostPath
volumes are the real host paths). The kernel log gets stand-ins (a test
must not write into the real kernel log or journal), and the state hostPath
is a temporary directory. The listen port is the one thing changed, so tests
can run side by side.

Two runs: one where the runtime lets the pod open /dev/kmsg (a file in the
kernel's record format stands in for it), and one where it does not, as
with containerd's device cgroup, so `auto` falls back to the host journal.
The second runs the daemon in a private mount namespace where /dev/kmsg is a
device node it may not open and /var/log holds real journal files, mounted
where the chart mounts the host's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatchd import config
from tests.conftest import ROOT, free_port, http_get
from tests.deploy.test_helm_chart import container, daemonset, kind, objects

XID_79 = (
    "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
)
BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")


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


class Pod:
    """The default chart's container, reproduced as a process on this machine."""

    def __init__(self, tmp: Path, standins: dict[str, Path]) -> None:
        objs = objects({})
        self.container = container({})
        (cm,) = [o for o in kind(objs, "ConfigMap") if "config.yaml" in o["data"]]
        self.mounts = {m["name"]: m for m in self.container["volumeMounts"]}
        self.rendered = yaml.safe_load(cm["data"]["config.yaml"])
        for name in ("state", "tmp"):
            standins[name] = tmp / name
            standins[name].mkdir()
        self.standins = standins
        # The full config the daemon sees: its defaults with the ConfigMap over them.
        self.full = yaml.safe_load(
            subprocess.run(
                [sys.executable, "-m", "gpuwatchd", "config", "default"],
                capture_output=True, text=True, check=True, cwd=ROOT, timeout=60,
            ).stdout
        )  # fmt: skip
        for section, values in self.rendered.items():
            for key, value in values.items():
                if isinstance(value, dict):
                    self.full[section][key].update(value)
                else:
                    self.full[section][key] = value
        self.port = free_port()
        self.full["http"]["listen"] = f"127.0.0.1:{self.port}"
        self.local = resolve(self.full, mounts(daemonset({}), standins))
        self.config = tmp / "config.yaml"
        self.config.write_text(yaml.safe_dump(self.local))
        config.load(str(self.config))  # the loader accepts it as the daemon will
        self.log_path = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wrapper: list[str] | None = None) -> None:
        c = self.container
        args = [str(self.config) if a == "/etc/gpuwatchd/config.yaml" else a for a in c["args"]]
        assert args == ["run", "--config", str(self.config)]
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        env["GPUWATCHD_NODE_NAME"] = "gpu-node-01"  # the downward API's spec.nodeName
        self.log = self.log_path.open("w+")
        self.proc = subprocess.Popen(
            [*(wrapper or []), sys.executable, "-m", "gpuwatchd", *args],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def metrics_until(self, pattern: str, timeout: float = 45) -> str:
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.port}/metrics"
        end = time.monotonic() + timeout
        body = ""
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.output()
            try:
                status, data = http_get(url)
            except OSError:
                status, data = 0, b""
            body = data.decode()
            if status == 200 and re.search(pattern, body):
                return body
            time.sleep(0.2)
        raise AssertionError(f"no {pattern} in {url}:\n{body}\n--- daemon ---\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return str(self.log.read())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(15)
            self.log.close()


def xid_count(body: str) -> float:
    found = re.findall(r'gpuwatchd_kmsg_reports_total\{kind="xid"\} (\S+)', body)
    return float(found[0]) if found else 0.0


def assert_caught_xid_79(pod: Pod, before: float) -> str:
    # the kernel log source counts the report; the Xid stage then classifies it
    body = pod.metrics_until(r'gpuwatchd_xid_errors_total\{[^}]*xid="79"[^}]*\} 1')
    assert xid_count(body) == before + 1, body
    return body


def test_defaults_ask_for_kmsg_with_the_journal_as_fallback() -> None:
    c = container({})
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    vm = {m["name"]: m for m in c["volumeMounts"]}
    assert vm["kmsg"] == {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}
    assert vm["var-log"]["mountPath"] == "/var/log" and vm["var-log"]["readOnly"] is True
    assert {"journal-run", "machine-id"} <= set(vm)
    (cm,) = [o for o in kind(objects({}), "ConfigMap") if "config.yaml" in o["data"]]
    rendered = yaml.safe_load(cm["data"]["config.yaml"])
    assert rendered["sources"]["kmsg"] == {"enabled": True, "backend": "auto"}


def test_default_chart_catches_an_xid_written_to_dev_kmsg(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,1000,-;Linux version 6.8.0 (builder@example)\n")
    pod = Pod(tmp_path, {"kmsg": kmsg})
    assert pod.local["paths"]["kmsg"] == str(kmsg)
    assert pod.local["daemon"]["state_dir"] == str(pod.standins["state"])
    assert pod.local["paths"]["sysfs"] == "/sys" and pod.local["paths"]["procfs"] == "/proc"
    # the workloads source finds the kubelet's socket where the chart mounts it
    assert pod.mounts["pod-resources"]["readOnly"] is True
    socket = Path(pod.full["sources"]["workloads"]["kubelet_socket"])
    assert str(socket.parent) == pod.mounts["pod-resources"]["mountPath"]
    pod.start()
    try:
        body = pod.metrics_until(r'gpuwatchd_kmsg_reader_up\{backend="kmsg"\} 1')
        before = xid_count(body)
        with kmsg.open("a") as f:
            f.write(f"3,2,5000000,-;{XID_79}\n")
        body = assert_caught_xid_79(pod, before)
    finally:
        pod.stop()


def pod_mounts(refused: Path, var_log: Path) -> list[str]:
    """Shell steps that give a private mount namespace the pod's kernel-log view."""
    # /dev/kmsg becomes the kernel's device node on a nodev mount, so opening it fails
    # as under a device cgroup that does not allow 1:11; /var/log is the stand-in.
    return [
        f"mount -t tmpfs -o nodev,size=64k none {refused}",
        f"mknod {refused}/kmsg c 1 11",
        f"mount --bind {refused}/kmsg /dev/kmsg",
        f"mount --bind {var_log} /var/log",
        # the host's volatile journal, if any, is hidden (the nodev mount has no journal files)
        f"if [ -d /run/log/journal ]; then mount --bind {refused} /run/log/journal; fi",
    ]


def _can_mount() -> bool:
    """Whether this machine lets the test build that view (root, mount namespaces)."""
    if not (shutil.which("unshare") and shutil.which("mount") and shutil.which("mknod")):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        script = "; ".join([*pod_mounts(Path(tmp), Path(tmp)), "true"])
        res = subprocess.run(
            ["unshare", "-m", "sh", "-ec", script], capture_output=True, timeout=10, check=False
        )
    return res.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount namespaces (unshare -m)")
def test_default_chart_falls_back_to_the_journal_when_kmsg_is_refused(tmp_path: Path) -> None:
    from tests.sources.test_journald_files import REMOTE, Journal

    if REMOTE is None:
        pytest.skip("systemd-journal-remote not installed")
    machine_id = Path("/etc/machine-id").read_text().strip()
    var_log = tmp_path / "var-log"  # the host's /var/log, as the chart mounts it
    (var_log / "journal" / machine_id).mkdir(parents=True)
    journal = Journal(var_log / "journal" / machine_id)
    journal.write(("kernel", "Linux version 6.8.0 (builder@example)"), ("syslog", "boot"))
    refused = tmp_path / "nodev"
    refused.mkdir()
    pod = Pod(tmp_path, {"kmsg": Path("/dev/kmsg"), "var-log": Path("/var/log")})
    assert pod.local["paths"]["kmsg"] == "/dev/kmsg"
    # In a private mount namespace: /dev/kmsg refused, /var/log holding the journal.
    script = "; ".join([*pod_mounts(refused, var_log), 'exec "$@"'])
    pod.start(["unshare", "-m", "sh", "-ec", script, "pod"])
    try:
        # auto tries /dev/kmsg first: the journal is in use only because it was refused
        body = pod.metrics_until(r'gpuwatchd_kmsg_reader_up\{backend="journald"\} 1')
        before = xid_count(body)
        journal.write(("syslog", XID_79), ("kernel", XID_79))  # the user-space copy is ignored
        body = assert_caught_xid_79(pod, before)
        assert re.search(r'gpuwatchd_kmsg_records_lost_total\{backend="journald"\} 0', body)
    finally:
        pod.stop()
