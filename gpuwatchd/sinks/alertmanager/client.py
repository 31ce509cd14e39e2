"""HTTP client for Alertmanager's API v2: one POST of an alert batch, TLS and auth.

No proxy from the environment is used: each Alertmanager is addressed
directly, as Prometheus does. Credentials are read from their files on
every request, so rotated tokens (Kubernetes projected tokens) just work.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatchd.config import AlertmanagerConfig

__all__ = ["AlertmanagerClient", "PostResult"]

log = logging.getLogger("gpuwatchd.alertmanager")


@dataclass(frozen=True)
class PostResult:
    """HTTP status (None if no answer came) and the start of a non-2xx body."""

    status: int | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _tls(cfg: AlertmanagerConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cfg.tls_ca_file or None)
    if cfg.tls_cert_file:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file or None)
    if cfg.tls_insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _plain_opener() -> urllib.request.OpenerDirector:
    # build_opener() would add an HTTPSHandler, whose default context loads ssl
    # (about 5 MiB) even when every Alertmanager is plain HTTP.
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler({}),
        urllib.request.UnknownHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


class AlertmanagerClient:
    """POSTs alert batches to `<url>/api/v2/alerts` with the configured TLS and auth."""

    def __init__(self, cfg: AlertmanagerConfig) -> None:
        self.cfg = cfg
        if any(u.lower().startswith("https:") for u in cfg.urls):
            self._opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=_tls(cfg))
            )
        else:
            self._opener = _plain_opener()

    def post(self, url: str, alerts: Sequence[dict[str, object]], timeout: float) -> PostResult:
        """One POST; never raises for network or HTTP errors."""
        req = urllib.request.Request(
            f"{url}/api/v2/alerts",
            data=json.dumps(list(alerts)).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "gpuwatchd"},
        )
        try:
            auth = self.auth_header()
            if auth:
                req.add_header("Authorization", auth)
            with self._opener.open(req, timeout=timeout) as resp:
                return PostResult(int(resp.status))
        except urllib.error.HTTPError as exc:
            text = exc.read(2048).decode("utf-8", "replace").strip()
            log.error("Alertmanager %s answered %d: %s", url, exc.code, text)
            return PostResult(exc.code, f"HTTP {exc.code}: {text[:200]}")
        except (OSError, ValueError) as exc:
            return PostResult(None, str(getattr(exc, "reason", exc)))

    def auth_header(self) -> str:
        """`Bearer ...` / `Basic ...` from the configured files, or empty."""
        cfg = self.cfg
        if cfg.bearer_token_file:
            with open(cfg.bearer_token_file, encoding="utf-8") as f:
                return f"Bearer {f.read().strip()}"
        if cfg.basic_auth_user:
            password = ""
            if cfg.basic_auth_password_file:
                with open(cfg.basic_auth_password_file, encoding="utf-8") as f:
                    password = f.read().rstrip("\n")
            token = base64.b64encode(f"{cfg.basic_auth_user}:{password}".encode()).decode()
            return f"Basic {token}"
        return ""
