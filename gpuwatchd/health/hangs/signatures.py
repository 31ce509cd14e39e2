"""The hang signature catalog (gpuwatchd/data/hang-signatures.yaml) and its matcher.

A signature matches when any of its `when` alternatives does: every fact
listed holds, and if frames are listed, one frame of one thread of one
rank matches one of the patterns. Facts come from the detector, the RAS
answer and the stacks (summary.facts()). Loaded once; a site file
replaces signatures by name and puts new ones first.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.config.yamlfile import load_yaml
from gpuwatchd.errors import ConfigError
from gpuwatchd.shipped import shipped_text

__all__ = [
    "Alternative",
    "Signature",
    "builtin_catalog",
    "load_catalog",
    "match",
    "parse_catalog",
]

SEVERITIES = ("warning", "critical")


@dataclass(frozen=True, slots=True)
class Alternative:
    """One way a signature can match."""

    facts: frozenset[str]
    frames: tuple[re.Pattern[str], ...] = ()

    def matches(self, facts: frozenset[str], frames: Sequence[str]) -> bool:
        """True when every fact holds and (if any patterns) one frame matches."""
        if not self.facts <= facts:
            return False
        if not self.frames:
            return True
        return any(p.search(f) for p in self.frames for f in frames)


@dataclass(frozen=True, slots=True)
class Signature:
    """A named hang pattern with its remediation."""

    name: str
    title: str
    severity: str
    remediation: str
    when: tuple[Alternative, ...]

    def matches(self, facts: frozenset[str], frames: Sequence[str]) -> bool:
        """True when any alternative matches."""
        return any(a.matches(facts, frames) for a in self.when)


def _fail(where: str, problem: str) -> ConfigError:
    path, _, key = where.partition(": ")
    return ConfigError(path, key, problem)


def _signature(raw: object, where: str) -> Signature:
    if not isinstance(raw, Mapping):
        raise _fail(where, "a signature must be a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(where, "signature without a name")
    where = f"{where}: signature {name}"
    severity = str(raw.get("severity", "warning"))
    if severity not in SEVERITIES:
        raise _fail(where, f"severity must be one of {', '.join(SEVERITIES)}")
    alternatives = []
    for alt in raw.get("when") or ():
        if not isinstance(alt, Mapping):
            raise _fail(where, "each `when` entry must be a mapping")
        try:
            frames = tuple(re.compile(str(p)) for p in alt.get("frames") or ())
        except re.error as e:
            raise _fail(where, f"bad frame pattern: {e}") from e
        alternatives.append(Alternative(frozenset(map(str, alt.get("facts") or ())), frames))
    if not alternatives:
        raise _fail(where, "`when` lists no alternative")
    return Signature(
        name=name,
        title=str(raw.get("title", name)),
        severity=severity,
        remediation=" ".join(str(raw.get("remediation", "")).split()),
        when=tuple(alternatives),
    )


def parse_catalog(doc: object, where: str = "hang signatures") -> tuple[Signature, ...]:
    """Signatures from a parsed YAML document; ConfigError naming the problem."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("signatures"), list):
        raise _fail(where, "expected a mapping with a `signatures` list")
    return tuple(_signature(s, where) for s in doc["signatures"])


@functools.cache
def builtin_catalog() -> tuple[Signature, ...]:
    """The shipped catalog, parsed once."""
    import yaml  # here: a node that never hangs needs no YAML parser

    text = shipped_text("hang-signatures.yaml")
    return parse_catalog(yaml.safe_load(text), "gpuwatchd/data/hang-signatures.yaml")


def load_catalog(site_file: str = "") -> tuple[Signature, ...]:
    """The shipped catalog with a site file's signatures replacing or preceding it."""
    base = builtin_catalog()
    if not site_file:
        return base
    try:
        with open(site_file, "rb") as f:
            text = f.read()
    except OSError as e:
        raise _fail(site_file, f"cannot read: {e.strerror}") from e
    site = parse_catalog(load_yaml(text, site_file), site_file)  # a repeated key is refused
    by_name = {s.name: s for s in site}
    replaced = [by_name.pop(s.name, s) for s in base]
    return (*[s for s in site if s.name in by_name], *replaced)


def match(
    catalog: Iterable[Signature], facts: Iterable[str], frames: Sequence[str]
) -> list[Signature]:
    """Every matching signature, best (first in the catalog) first."""
    fs = frozenset(facts)
    return [s for s in catalog if s.matches(fs, frames)]
