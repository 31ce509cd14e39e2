"""TLS and basic auth for the HTTP endpoints, from an exporter-toolkit web-config.yml.

The file format is the one node_exporter users already have
(`tls_server_config`, `http_server_config`, `basic_auth_users` with bcrypt
hashes); relative paths are relative to the file. `load()` validates
everything at start, including that the certificate and key load, and
raises ConfigError naming the file, the key and the problem. The HTTP server
checks credentials with it (http/auth.py). The file and the certificates it names are
re-read when they change (certificate rotation), keeping the last good
version if the new one is bad.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.config.yamlfile import load_yaml
from gpuwatchd.errors import ConfigError

__all__ = [
    "IO_TIMEOUT",
    "PUBLIC_PATHS",
    "TlsSettings",
    "WebConfig",
    "WebConfigWatcher",
    "load",
    "ssl_context",
    "with_headers",
]

log = logging.getLogger("gpuwatchd.http")

App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

# Liveness only ("ok" or the names of stale sources): kubelet and load balancer
# probes cannot present credentials or client certificates.
PUBLIC_PATHS = frozenset({"/healthz"})
IO_TIMEOUT = 10.0

# Names in ssl, oldest first, looked up only when TLS is on.
TLS_VERSIONS = {
    "TLS10": "TLSv1",
    "TLS11": "TLSv1_1",
    "TLS12": "TLSv1_2",
    "TLS13": "TLSv1_3",
}
# exporter-toolkit's values; the two that ask for a certificate without verifying
# it have no equivalent in Python's ssl module.
CLIENT_AUTH = {
    "NoClientCert": "CERT_NONE",
    "VerifyClientCertIfGiven": "CERT_OPTIONAL",
    "RequireAndVerifyClientCert": "CERT_REQUIRED",
}
UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
# Go (IANA) cipher suite names -> OpenSSL names; TLS 1.3 suites are not configurable.
CIPHERS = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
}
# Response headers exporter-toolkit lets the file set, with the values it accepts.
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "Content-Security-Policy": None,
    "X-XSS-Protection": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
}
TLS_KEYS = frozenset(
    {"cert_file", "key_file", "client_auth_type", "client_ca_file", "client_allowed_sans",
     "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
     "curve_preferences", "cert", "key", "client_ca"}
)  # fmt: skip


@dataclass(frozen=True)
class TlsSettings:
    """tls_server_config with paths made absolute."""

    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)


@dataclass(frozen=True)
class WebConfig:
    """A validated web-config.yml. `context` is None for plain HTTP."""

    path: str = ""
    tls: TlsSettings | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()
    context: ssl.SSLContext | None = None


def load(path: str) -> WebConfig:
    """Read and validate a web-config.yml; an empty path means plain HTTP, no auth."""
    if not path:
        return WebConfig()
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror or exc}") from None
    data = load_yaml(text, path)  # invalid YAML or a repeated key: ConfigError naming it
    data = {} if data is None else data
    _mapping(path, "(top level)", data)
    unknown = set(data) - {"tls_server_config", "http_server_config", "basic_auth_users"}
    if unknown:
        raise ConfigError(path, sorted(map(str, unknown))[0], "unknown key")
    base = os.path.dirname(os.path.abspath(path))
    tls = _tls(path, base, data.get("tls_server_config"))
    users = _users(path, data.get("basic_auth_users"))
    headers = _http(path, data.get("http_server_config"))
    context = ssl_context(tls, path) if tls else None
    if users and context is None:
        log.warning("%s: basic auth without TLS sends passwords in clear text", path)
    return WebConfig(os.path.abspath(path), tls, users, headers, context)


def _mapping(path: str, key: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(path, key, f"must be a mapping, got {type(value).__name__}")
    return value


def _str(path: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, key, f"must be a string, got {type(value).__name__}")
    return value


def _strs(path: str, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(path, key, f"must be a list, got {type(value).__name__}")
    return tuple(_str(path, f"{key}[{i}]", v) for i, v in enumerate(value))


def _tls(path: str, base: str, raw: object) -> TlsSettings | None:
    if raw is None:
        return None
    t = _mapping(path, "tls_server_config", raw)
    key = "tls_server_config."
    for k in t:
        if k not in TLS_KEYS:
            raise ConfigError(path, key + str(k), "unknown key")
    for k in ("cert", "key", "client_ca"):
        if k in t:
            raise ConfigError(path, key + k, f"inline PEM is not supported; use {k}_file")
    if "curve_preferences" in t:
        raise ConfigError(path, key + "curve_preferences", "not supported; remove it")
    cert = _str(path, key + "cert_file", t.get("cert_file", ""))
    priv = _str(path, key + "key_file", t.get("key_file", ""))
    if not cert and not priv:
        if set(t) - {"cert_file", "key_file"}:
            raise ConfigError(path, key + "cert_file", "required when TLS options are set")
        return None  # an empty section: plain HTTP, as exporter-toolkit does
    if not cert or not priv:
        raise ConfigError(path, key + ("key_file" if cert else "cert_file"), "missing")
    auth = _str(path, key + "client_auth_type", t.get("client_auth_type", "NoClientCert"))
    if auth in UNSUPPORTED_CLIENT_AUTH:
        raise ConfigError(
            path, key + "client_auth_type",
            f"{auth} is not supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert",
        )  # fmt: skip
    if auth not in CLIENT_AUTH:
        raise ConfigError(path, key + "client_auth_type", f"unknown value {auth!r}")
    ca = _str(path, key + "client_ca_file", t.get("client_ca_file", ""))
    if CLIENT_AUTH[auth] != "CERT_NONE" and not ca:
        raise ConfigError(path, key + "client_ca_file", f"required with {auth}")
    if ca and CLIENT_AUTH[auth] == "CERT_NONE":
        raise ConfigError(path, key + "client_auth_type", "client_ca_file is set: choose a mode")
    sans = _strs(path, key + "client_allowed_sans", t.get("client_allowed_sans", []))
    if sans and not ca:
        raise ConfigError(path, key + "client_allowed_sans", "needs client certificates")
    versions = []
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = _str(path, key + k, t.get(k, default))
        if v not in TLS_VERSIONS:
            raise ConfigError(path, key + k, f"must be one of {', '.join(TLS_VERSIONS)}")
        versions.append(v)
    order = list(TLS_VERSIONS)
    if order.index(versions[0]) > order.index(versions[1]):
        raise ConfigError(path, key + "min_version", "is above max_version")
    suites = _strs(path, key + "cipher_suites", t.get("cipher_suites", []))
    for i, s in enumerate(suites):
        if s not in CIPHERS:
            raise ConfigError(path, f"{key}cipher_suites[{i}]", f"unknown cipher suite {s!r}")
    prefer = t.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(path, key + "prefer_server_cipher_suites", "must be true or false")

    def absolute(p: str) -> str:
        return os.path.normpath(os.path.join(base, p)) if p else ""

    return TlsSettings(
        absolute(cert), absolute(priv), auth, absolute(ca), sans, versions[0], versions[1],
        suites, prefer,
    )  # fmt: skip


def _users(path: str, raw: object) -> dict[str, bytes]:
    if raw is None:
        return {}
    users: dict[str, bytes] = {}
    for name, hashed in _mapping(path, "basic_auth_users", raw).items():
        key = f"basic_auth_users.{name}"
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(path, key, "user names must be non-empty strings without ':'")
        h = _str(path, key, hashed)
        if len(h) != 60 or h[:4] not in ("$2a$", "$2b$", "$2y$"):
            raise ConfigError(path, key, "must be a bcrypt hash ($2y$..., 60 characters)")
        users[name] = h.encode()
    return users


def _http(path: str, raw: object) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    h = _mapping(path, "http_server_config", raw)
    for k in h:
        if k not in ("http2", "headers"):
            raise ConfigError(path, f"http_server_config.{k}", "unknown key")
    if not isinstance(h.get("http2", True), bool):
        raise ConfigError(path, "http_server_config.http2", "must be true or false")
    out = []
    for name, value in _mapping(path, "http_server_config.headers", h.get("headers", {})).items():
        key = f"http_server_config.headers.{name}"
        if name not in HEADERS:
            raise ConfigError(path, key, f"not one of {', '.join(HEADERS)}")
        allowed = HEADERS[name]
        if allowed is not None and str(value).lower() not in allowed:
            raise ConfigError(path, key, f"must be one of {', '.join(allowed)}")
        out.append((str(name), _str(path, key, value)))
    return tuple(out)


def ssl_context(tls: TlsSettings, path: str = "") -> ssl.SSLContext:
    """A server-side SSLContext for `tls`; problems raise ConfigError."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = getattr(ssl.TLSVersion, TLS_VERSIONS[tls.min_version])
    ctx.maximum_version = getattr(ssl.TLSVersion, TLS_VERSIONS[tls.max_version])
    key = "tls_server_config."
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            path, key + "cert_file", f"cannot load certificate and key: {exc}"
        ) from None
    ctx.verify_mode = getattr(ssl, CLIENT_AUTH[tls.client_auth_type])
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(path, key + "client_ca_file", f"cannot load: {exc}") from None
    if tls.cipher_suites:
        try:
            ctx.set_ciphers(":".join(CIPHERS[s] for s in tls.cipher_suites))
        except ssl.SSLError as exc:
            raise ConfigError(path, key + "cipher_suites", f"rejected by OpenSSL: {exc}") from None
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx


class WebConfigWatcher:
    """The current WebConfig, re-loaded when the file or a file it names changes."""

    def __init__(self, web: WebConfig) -> None:
        self._web = web
        self._lock = threading.Lock()
        self._stamp = self._stamps(web)

    def _stamps(self, web: WebConfig) -> tuple[tuple[float, int], ...]:
        out = []
        for f in (web.path, *(web.tls.files() if web.tls else ())):
            try:
                st = os.stat(f) if f else None
            except OSError:
                st = None
            out.append((st.st_mtime, st.st_size) if st else (0.0, 0))
        return tuple(out)

    def current(self) -> WebConfig:
        web = self._web
        if not web.path or self._stamps(web) == self._stamp:
            return web
        with self._lock:
            stamp = self._stamps(self._web)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._web = load(self._web.path)
                    log.info("reloaded %s", self._web.path)
                except ConfigError as exc:
                    log.error("keeping the previous web config: %s", exc)
            return self._web


def with_headers(app: App, watcher: WebConfigWatcher) -> App:
    """WSGI middleware: the response headers of `http_server_config.headers`."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        extra = list(watcher.current().headers)

        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            return start_response(status, headers + extra, *exc)

        return app(environ, start if extra else start_response)

    return wrapped
