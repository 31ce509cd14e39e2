"""Checks across keys and against the machine: the one validation `run` and `config check` share.

`validate(cfg, file)` runs every check and raises one `ConfigErrors` that
lists all problems found (one line each), never only the first.
"""

from __future__ import annotations

import os
import re
import shutil
import urllib.parse
from collections.abc import Callable

from gpuwatchd.config.problems import ConfigErrors, raise_all
from gpuwatchd.config.schema import Config
from gpuwatchd.errors import ConfigError

__all__ = [
    "ConfigErrors",
    "RESERVED_LABELS",
    "check_alertmanager",
    "check_named_files",
    "check_paths",
    "check_state_dir",
    "check_xid_codes",
    "raise_all",
    "validate",
    "validate_listen",
]

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]{0,127}")
RESERVED_LABELS = ("alertname", "severity", "node", "gpu", "uuid", "pci_bus_id", "xid")
MAX_CODE = 999_999  # the kernel log parser reads no larger Xid/SXid code
_AM_FILES = (
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "basic_auth_password_file",
    "bearer_token_file",
)


def validate(cfg: Config, file: str) -> None:
    """Every check `run` makes before it starts; raises ConfigError(s) listing all problems."""
    errors: list[ConfigError] = []
    checks: tuple[Callable[[Config, str], None], ...] = (
        check_paths,
        validate_listen,
        check_alertmanager,
        check_xid_codes,
        check_state_dir,
        check_named_files,
    )
    for check in checks:
        try:
            check(cfg, file)
        except ConfigError as exc:
            errors.append(exc)
    raise_all(errors)


def check_paths(cfg: Config, file: str) -> None:
    """Files the config names must exist and be readable."""
    k8s = cfg.remediation.kubernetes
    named = {
        "sources.nvml.replay": cfg.sources.nvml.replay,
        "http.web_config_file": cfg.http.web_config_file,
        **{f"alertmanager.{k}": getattr(cfg.alertmanager, k) for k in _AM_FILES},
        "hangs.signatures_file": cfg.hangs.signatures_file,
        "diag.floors_file": cfg.diag.floors_file,
        "remediation.kubernetes.token_file": k8s.token_file,
        "remediation.kubernetes.ca_file": k8s.ca_file,
    }
    errors: list[ConfigError] = []
    for key, value in named.items():
        if value:
            try:
                open(value, "rb").close()
            except OSError as exc:
                errors.append(ConfigError(file, key, f"cannot read {value}: {exc.strerror or exc}"))
    raise_all(errors)


def validate_listen(cfg: Config, file: str) -> None:
    """`http.listen` must be host:port."""
    _host, sep, port = cfg.http.listen.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 <= int(port) <= 65535:
        raise ConfigError(file, "http.listen", f"must be host:port, got {cfg.http.listen!r}")


def check_alertmanager(cfg: Config, file: str) -> None:
    """URLs (never with credentials in them), static labels and the auth choice."""
    am = cfg.alertmanager
    errors: list[ConfigError] = []
    for i, url in enumerate(am.urls):
        key = f"alertmanager.urls[{i}]"
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port  # raises ValueError when out of range
        except ValueError as exc:
            errors.append(ConfigError(file, key, f"not a URL: {exc}"))
            continue
        if "@" in parts.netloc:
            # Never echo the URL: it holds a secret.
            errors.append(
                ConfigError(
                    file,
                    key,
                    "credentials in the URL are not allowed (they would leak into metrics,"
                    " /status and logs); use alertmanager.basic_auth_user and"
                    " alertmanager.basic_auth_password_file, or bearer_token_file",
                )
            )
        elif parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
            errors.append(ConfigError(file, key, f"must be http(s)://host[:port], got {url!r}"))
    for key in ("external_url", "runbook_base_url"):
        # Both end up in every alert (generatorURL, runbook_url).
        if "@" in urllib.parse.urlsplit(getattr(am, key)).netloc:
            errors.append(
                ConfigError(file, f"alertmanager.{key}", "credentials in the URL are not allowed")
            )
    for name, value in am.static_labels.items():
        key = f"alertmanager.static_labels.{name}"
        if not LABEL_NAME.fullmatch(name) or name.startswith("__"):
            errors.append(ConfigError(file, key, "invalid label name"))
        elif name in RESERVED_LABELS:
            errors.append(ConfigError(file, key, "reserved label name"))
        elif not value:
            errors.append(ConfigError(file, key, "empty value"))
    if am.basic_auth_user and am.bearer_token_file:
        errors.append(
            ConfigError(file, "alertmanager.bearer_token_file", "use basic auth or a token")
        )
    raise_all(errors)


def check_xid_codes(cfg: Config, file: str) -> None:
    """`xid.overrides` / `xid.sxid_overrides` keys are codes (0..999999)."""
    errors: list[ConfigError] = []
    for key in ("overrides", "sxid_overrides"):
        for name in getattr(cfg.xid, key):
            if not (name.isdigit() and len(name) <= 6 and int(name) <= MAX_CODE):
                errors.append(ConfigError(file, f"xid.{key}.{name}", "must be a numeric code"))
    raise_all(errors)


def check_state_dir(cfg: Config, file: str) -> None:
    """The state dir is writable, or can be created (it is not created here)."""
    path = os.path.abspath(cfg.daemon.state_dir)
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(
            file, "daemon.state_dir", f"cannot create {path}: {probe} is not a directory"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{path} is not writable"
        if probe != path:
            problem = f"cannot create {path}: {probe} is not writable"
        raise ConfigError(file, "daemon.state_dir", problem)


def check_named_files(cfg: Config, file: str) -> None:
    """What core can check inside the files the config names: floors, TLS material, tokens.

    The replay capture, hang signatures and web config are read by the layers
    that parse them (gpuwatchd/preflight.py), for `run` and `config check` alike.
    """
    errors: list[ConfigError] = []
    for check in (_check_floors, _check_tls_files, _check_tokens, _check_diag_python):
        try:
            check(cfg, file)
        except ConfigError as exc:
            errors.append(exc)
    raise_all(errors)


def _check_floors(cfg: Config, file: str) -> None:
    if cfg.diag.floors_file and os.access(cfg.diag.floors_file, os.R_OK):
        from gpuwatchd.config.floors import load_floors  # PyYAML: only with a floors file

        load_floors(cfg.diag.floors_file)  # names the floors file and the key in it


def _check_tls_files(cfg: Config, file: str) -> None:
    """Certificates and keys load as the TLS client will load them."""
    am = cfg.alertmanager
    if am.tls_key_file and not am.tls_cert_file:
        raise ConfigError(file, "alertmanager.tls_key_file", "needs alertmanager.tls_cert_file")
    k8s = cfg.remediation.kubernetes
    if not (am.tls_ca_file or am.tls_cert_file or k8s.ca_file):
        return
    import ssl  # here: about 5 MiB that a node without TLS files never loads

    errors: list[ConfigError] = []
    cas = (
        ("alertmanager.tls_ca_file", am.tls_ca_file),
        ("remediation.kubernetes.ca_file", k8s.ca_file),
    )
    for key, path in cas:
        if path and os.access(path, os.R_OK):
            try:
                ssl.create_default_context().load_verify_locations(cafile=path)
            except (ssl.SSLError, OSError, ValueError) as exc:
                errors.append(ConfigError(file, key, f"{path}: not a CA bundle: {_ssl_why(exc)}"))
    if am.tls_cert_file and os.access(am.tls_cert_file, os.R_OK):
        try:
            ctx = ssl.create_default_context()
            ctx.load_cert_chain(am.tls_cert_file, am.tls_key_file or None)
        except (ssl.SSLError, OSError, ValueError) as exc:
            key = "alertmanager.tls_cert_file"
            errors.append(ConfigError(file, key, f"certificate and key: {_ssl_why(exc)}"))
    raise_all(errors)


def _ssl_why(exc: Exception) -> str:
    return str(getattr(exc, "reason", "") or getattr(exc, "strerror", "") or exc)


def _check_tokens(cfg: Config, file: str) -> None:
    """A token file that is empty would send an empty credential on every request."""
    named = (
        ("alertmanager.bearer_token_file", cfg.alertmanager.bearer_token_file),
        ("remediation.kubernetes.token_file", cfg.remediation.kubernetes.token_file),
    )
    for key, path in named:
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                empty = not f.read(64 << 10).strip()
        except OSError:
            continue  # check_paths says why
        if empty:
            raise ConfigError(file, key, f"{path} is empty")


def _check_diag_python(cfg: Config, file: str) -> None:
    """diag.python must be an interpreter that can be started."""
    exe = cfg.diag.python
    if (
        exe
        and not (os.path.isfile(exe) and os.access(exe, os.X_OK))
        and not ("/" not in exe and shutil.which(exe))
    ):
        raise ConfigError(file, "diag.python", f"{exe}: not an executable file")
