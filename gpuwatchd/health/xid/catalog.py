"""The Xid/SXid catalog: what a code means, how bad it is, and what to do.

The catalog ships as data (gpuwatchd/data/xid-catalog.yaml, the full,
annotated source) plus a compact JSON form with only the fields the daemon
uses (scripts/build_catalog.py), so a CLI start does not pay for parsing
340 KB of YAML. It is loaded once, validated, and can be overridden or
extended per site from the `xid:` config section.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpuwatchd.errors import CatalogError, ConfigError
from gpuwatchd.health.xid import nvlink5
from gpuwatchd.model import Action, Severity
from gpuwatchd.shipped import shipped_text

if TYPE_CHECKING:
    from gpuwatchd.config import Config

__all__ = [
    "CATEGORIES",
    "Catalog",
    "LineOverride",
    "XidInfo",
    "build",
    "default_catalog",
    "from_config",
    "load_catalog",
    "lookup",
]

CATEGORIES = frozenset(
    {"hardware", "driver", "application", "nvlink", "memory", "thermal_power", "fabric", "unknown"}
)
KINDS = ("xid", "sxid")
_DISRUPTIVE = frozenset({Action.REBOOT_NODE, Action.RESET_GPU})


@dataclass(frozen=True, slots=True)
class LineOverride:
    """Severity/action that the text of one report selects (Xid 144-150, 154)."""

    severity: Severity
    action: Action
    contains: str = ""
    recovery_action: str = ""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """Everything the daemon knows about one Xid or SXid code."""

    kind: str
    code: int
    name: str
    category: str
    severity: Severity
    action: Action
    remediation: str
    mnemonic: str = ""
    known: bool = True
    line_overrides: tuple[LineOverride, ...] = ()

    @property
    def label(self) -> str:
        """`Xid 79` / `SXid 12028`."""
        return f"{'SXid' if self.kind == 'sxid' else 'Xid'} {self.code}"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "code": self.code,
            "name": self.name,
            "category": self.category,
            "severity": str(self.severity),
            "action": str(self.action),
            "remediation": self.remediation,
            "mnemonic": self.mnemonic,
            "known": self.known,
        }


class Catalog:
    """Lookup of Xid and SXid codes; unknown codes get a clear warning entry."""

    def __init__(
        self,
        entries: Iterable[XidInfo],
        unknown: Mapping[str, XidInfo],
        actions: Mapping[str, str],
    ) -> None:
        self._by: dict[tuple[str, int], XidInfo] = {}
        for info in entries:
            self._by[(info.kind, info.code)] = info
        self._unknown = dict(unknown)
        self.actions = dict(actions)

    def __len__(self) -> int:
        return len(self._by)

    def codes(self, kind: str = "xid") -> list[int]:
        return sorted(code for k, code in self._by if k == kind)

    def lookup(self, code: int, kind: str = "xid") -> XidInfo:
        """The entry for `code`; never raises (unknown codes get `unknown Xid`)."""
        info = self._by.get((kind, code))
        if info is not None:
            return info
        base = self._unknown.get(kind) or self._unknown["xid"]
        return replace(base, kind=kind, code=code)

    def resolve(
        self,
        code: int,
        kind: str = "xid",
        text: str = "",
        fatal: bool | None = None,
        recovery_action: str = "",
    ) -> XidInfo:
        """The entry adjusted by what the report itself says (trust the line)."""
        info = self.lookup(code, kind)
        if kind == "xid" and info.line_overrides:
            # NVLink5: the decoded unit/status decides before the Fatal/Nonfatal word
            rule = nvlink5.decide(code, text)
            if rule is not None:
                return replace(info, severity=rule.severity, action=rule.action)
        for ov in info.line_overrides:
            if (ov.contains and ov.contains in text) or (
                ov.recovery_action and ov.recovery_action == recovery_action
            ):
                return replace(info, severity=ov.severity, action=ov.action)
        if kind == "sxid" and fatal is not None:
            # The switch driver says per report whether the fabric absorbed it.
            if fatal and info.severity < Severity.CRITICAL:
                action = info.action if info.action is not Action.NONE else Action.REBOOT_NODE
                return replace(info, severity=Severity.CRITICAL, action=action)
            if not fatal:
                # absorbed by the fabric: track it, but a reboot or reset is not called for
                kept = Action.NONE if info.action in _DISRUPTIVE else info.action
                return replace(info, severity=min(info.severity, Severity.WARNING), action=kept)
        return info

    def action_text(self, action: Action) -> str:
        return self.actions.get(str(action), "")

    def with_site(self, kind: str, rules: Mapping[int, Mapping[str, Any]]) -> Catalog:
        """A copy with site rules applied: severity/action/name/remediation per code."""
        entries = dict(self._by)
        for code, rule in rules.items():
            base = self.lookup(code, kind)
            changes: dict[str, Any] = {}
            if rule.get("severity"):
                changes["severity"] = Severity.parse(str(rule["severity"]))
                changes["line_overrides"] = ()  # the site decided; the line no longer does
            if rule.get("action"):
                changes["action"] = Action(str(rule["action"]))
                changes["line_overrides"] = ()
            if rule.get("name"):
                changes["name"] = str(rule["name"])
                changes["known"] = True
            if rule.get("remediation"):
                changes["remediation"] = str(rule["remediation"])
            if changes:
                entries[(kind, code)] = replace(base, **changes)
        return Catalog(entries.values(), self._unknown, self.actions)


# --- loading -------------------------------------------------------------------


def _entry(kind: str, raw: Mapping[str, Any], where: str) -> XidInfo:
    try:
        code = raw["code"]
        if not isinstance(code, int) or isinstance(code, bool) or code < 0:
            raise CatalogError(f"{where}.code: must be a non-negative integer, got {code!r}")
        category = str(raw["category"])
        if category not in CATEGORIES:
            raise CatalogError(f"{where}.category: unknown category {category!r}")
        overrides = tuple(
            LineOverride(
                severity=Severity.parse(str(o["severity"])),
                action=Action(str(o["action"])),
                contains=str(o.get("when_line_contains") or ""),
                recovery_action=str(o.get("when_recovery_action_is") or ""),
            )
            for o in raw.get("line_overrides") or ()
        )
        return XidInfo(
            kind=kind,
            code=code,
            name=str(raw["name"]),
            category=category,
            severity=Severity.parse(str(raw["severity"])),
            action=Action(str(raw["action"])),
            remediation=str(raw["remediation"]),
            mnemonic=str(raw.get("mnemonic") or ""),
            line_overrides=overrides,
        )
    except KeyError as exc:
        raise CatalogError(f"{where}: missing field {exc.args[0]}") from None
    except ValueError as exc:  # bad severity or action word
        raise CatalogError(f"{where}: {exc}") from None


def build(data: Mapping[str, Any]) -> Catalog:
    """Validate catalog data (compact JSON or the full YAML) into a Catalog."""
    if not isinstance(data, Mapping):
        raise CatalogError("catalog: top level must be a mapping")
    if data.get("schema_version") != 1:
        raise CatalogError(f"schema_version: unsupported {data.get('schema_version')!r}")
    entries: list[XidInfo] = []
    for kind in KINDS:
        seen: set[int] = set()
        for i, raw in enumerate(data.get(kind) or ()):
            info = _entry(kind, raw, f"{kind}[{i}]")
            if info.code in seen:
                raise CatalogError(f"{kind}[{i}].code: duplicate code {info.code}")
            seen.add(info.code)
            entries.append(info)
    base = data.get("unknown_code")
    if not isinstance(base, Mapping):
        raise CatalogError("unknown_code: missing")
    unknown_xid = _entry("xid", {"code": 0, **base}, "unknown_code")
    unknown = {
        "xid": replace(unknown_xid, known=False),
        "sxid": replace(unknown_xid, kind="sxid", name="Unknown SXid", known=False),
    }
    actions = data.get("actions") or {}
    missing = {str(a) for a in Action} - set(actions)
    if missing:
        raise CatalogError(f"actions: no text for {', '.join(sorted(missing))}")
    return Catalog(entries, unknown, {str(k): str(v) for k, v in actions.items()})


def load_catalog(path: str | None = None) -> Catalog:
    """Load a catalog file (.json compact or .yaml full); None = the shipped one."""
    if path is None:
        text = shipped_text("xid-catalog.json")
        return build(json.loads(text))
    with open(path, encoding="utf-8") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            return build(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
        return build(json.load(f))


@functools.cache
def default_catalog() -> Catalog:
    """The shipped catalog, loaded once per process."""
    return load_catalog()


def lookup(code: int, kind: str = "xid") -> XidInfo:
    """Look a code up in the shipped catalog."""
    return default_catalog().lookup(code, kind)


def from_config(cfg: Config) -> Catalog:
    """The shipped catalog with the site's `xid.overrides` / `xid.sxid_overrides` applied."""
    cat = default_catalog()
    for kind, key in (("xid", "overrides"), ("sxid", "sxid_overrides")):
        rules: dict[int, Mapping[str, Any]] = {}
        for name, rule in getattr(cfg.xid, key).items():
            try:
                code = int(name)
            except ValueError:
                raise ConfigError("", f"xid.{key}.{name}", "must be a numeric code") from None
            rules[code] = {
                "severity": rule.severity,
                "action": rule.action,
                "name": rule.name,
                "remediation": rule.remediation,
            }
        if rules:
            cat = cat.with_site(kind, rules)
    return cat
