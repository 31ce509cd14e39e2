"""An alert's labels and annotations as Alertmanager takes them, and the config checks."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpuwatchd.config import Config
from gpuwatchd.config.validate import check_alertmanager, check_paths, raise_all
from gpuwatchd.errors import ConfigError
from gpuwatchd.health.alerts import ALERTS, GPU_LABELS
from gpuwatchd.model import Finding

__all__ = ["alert_labels", "printable", "valid", "validate_config"]

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def validate_config(cfg: Config, file: str = "") -> None:
    """Raise ConfigError for URLs, labels or credential files that cannot work."""
    errors: list[ConfigError] = []
    for check in (check_alertmanager, check_paths):
        try:
            check(cfg, file)
        except ConfigError as exc:
            errors.append(exc)
    raise_all(errors)


def alert_labels(finding: Finding, node: str, static: Mapping[str, str]) -> dict[str, str]:
    """The label set of a finding's alert; the same set the Prometheus rules produce.

    Only the alert name's declared labels (alerts.ALERTS[...].labels) are
    kept from the finding; other detail belongs in the description.
    """
    info = ALERTS.get(finding.alertname)
    keep = set(info.labels) if info is not None else set(GPU_LABELS)
    labels = {k: v for k, v in static.items() if v}
    labels.update((k, v) for k, v in (*finding.subject, *finding.labels) if v and k in keep)
    labels.update(alertname=finding.alertname, severity=str(finding.severity), node=node)
    return labels


def valid(mapping: Mapping[str, str]) -> bool:
    """Whether Alertmanager takes these as labels (names, UTF-8, an alertname)."""
    for key, value in mapping.items():
        if not _LABEL_NAME.match(key) or key.startswith("__") or not isinstance(value, str):
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return bool(mapping.get("alertname"))


def printable(text: str) -> str:
    """`text` with undecodable characters replaced."""
    return text.encode("utf-8", "replace").decode("utf-8")
