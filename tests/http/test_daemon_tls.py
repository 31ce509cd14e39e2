"""`gpuwatchd run` (which loads ssl only when TLS is used) serves HTTPS with basic auth.

The daemon defers the ssl module until something uses it; this drives the real
process with a web-config file and a real HTTPS client that verifies the
certificate, so a lazy ssl that broke TLS would fail here.
"""

from __future__ import annotations

import base64
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.web_tls import tls_basic_auth_web

PASSWORD = "tls-e2e-password"


def test_daemon_serves_https_with_basic_auth(tmp_path: Path, start_daemon: Any) -> None:
    ca_file, web = tls_basic_auth_web(tmp_path, PASSWORD)
    replay = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h100-idle-record.json"
    d = start_daemon(
        f"http:\n  web_config_file: {web}\nsources:\n  nvml: {{replay: {replay}}}\n"
        "  kmsg: {enabled: false}\n  udev: {enabled: false}\n"
    )
    ctx = ssl.create_default_context(cafile=str(ca_file))
    url = f"https://127.0.0.1:{d.port}/metrics"
    token = base64.b64encode(f"prom:{PASSWORD}".encode()).decode()
    req = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        body = resp.read().decode()
    assert resp.status == 200 and "gpuwatchd_gpu_info" in body
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(url, context=ctx, timeout=10)
    denied.value.close()
    assert denied.value.code == 401
    with pytest.raises(OSError):  # plain HTTP on the TLS port is refused (reset or error)
        urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=10)
