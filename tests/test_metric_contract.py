"""Every metric a consumer reads is produced by some MetricSpec.

Consumers: the Prometheus rules and their promtool tests (deploy/prometheus,
and the chart's copy), the Grafana dashboards (deploy/grafana, and the
chart's copies), the health rules (string constants in gpuwatchd/health)
and the runbooks. Producers: every spec scripts/gen_metrics_doc.py collects
(the same list docs/metrics.md is generated from), plus the outputs of the
recording rules.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from gpuwatchd.model import MetricSpec

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# A metric or recording-rule name; a trailing "_" marks a prefix the code extends.
NAME = re.compile(r"(?<![A-Za-z0-9_/.-])gpuwatchd[_:][A-Za-z0-9_:]*")
EXACT = re.compile(r"gpuwatchd_[a-z0-9_]+")


@cache
def specs() -> tuple[MetricSpec, ...]:
    path = ROOT / "scripts" / "gen_metrics_doc.py"
    loader = importlib.util.spec_from_file_location("gen_metrics_doc", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return tuple(spec for _producer, spec in module.collect())


def rule_files() -> list[Path]:
    return sorted(
        [*(DEPLOY / "prometheus").glob("*.yaml"), *(DEPLOY / "helm").rglob("*rules*.yaml")]
    )


def dashboards() -> list[Path]:
    return sorted(
        [*(DEPLOY / "grafana").glob("*.json"), *(DEPLOY / "helm").rglob("dashboards/*.json")]
    )


def recorded_names() -> set[str]:
    out: set[str] = set()
    for path in rule_files():
        doc = yaml.safe_load(path.read_text()) or {}
        for group in doc.get("groups", []):
            out.update(r["record"] for r in group.get("rules", []) if "record" in r)
    return out


def produced() -> set[str]:
    return {s.name for s in specs()} | recorded_names()


def names_in_text(text: str) -> set[str]:
    return set(NAME.findall(text))


def names_in_python(source: str) -> set[str]:
    """String constants that are a whole metric name or a metric name prefix."""
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and EXACT.fullmatch(node.value)
    }


def unproduced(names: set[str], have: set[str]) -> list[str]:
    """Names (or prefixes ending in _) that nothing produces."""
    missing = []
    for name in sorted(names):
        if name.endswith(("_", ":")):
            if not any(h.startswith(name) for h in have):
                missing.append(name + "*")
        elif name not in have:
            missing.append(name)
    return missing


def consumers() -> list[tuple[str, set[str]]]:
    out = [(str(p.relative_to(ROOT)), names_in_text(p.read_text())) for p in rule_files()]
    out += [(str(p.relative_to(ROOT)), names_in_text(p.read_text())) for p in dashboards()]
    out += [
        (str(p.relative_to(ROOT)), names_in_text(p.read_text()))
        for p in sorted((ROOT / "docs" / "runbooks").glob("*.md"))
    ]
    out += [
        (str(p.relative_to(ROOT)), names_in_python(p.read_text()))
        for p in sorted((ROOT / "gpuwatchd" / "health").rglob("*.py"))
    ]
    return [(path, names) for path, names in out if names]


def test_spec_names_are_unique_and_prefixed() -> None:
    names = [s.name for s in specs()]
    assert len(names) == len(set(names))
    assert all(n.startswith("gpuwatchd_") for n in names)
    assert all(s.name.endswith("_total") for s in specs() if s.type == "counter")


# Words of a name that mean a unit other than the base one (Prometheus conventions, as
# node_exporter names them: seconds, bytes, hertz, joules, watts, celsius, ratios).
NON_BASE_UNITS = frozenset(
    "hz khz mhz ghz ms milliseconds us microseconds ns nanoseconds minutes hours days "
    "kb mb gb kib mib gib mw milliwatts mj millijoules percent pct fahrenheit kelvin".split()
)


def test_spec_names_are_in_base_units() -> None:
    bad = [s.name for s in specs() if NON_BASE_UNITS & set(s.name.split("_"))]
    assert bad == [], "name these in base units (e.g. _hertz, _seconds, _bytes, _ratio)"


def test_consumers_found() -> None:
    # the scan must see the files it promises to check, or it checks nothing
    found = dict(consumers())
    assert any("rules.yaml" in k for k in found) and any(k.endswith(".json") for k in found)
    assert len(found["deploy/prometheus/gpuwatchd-rules.yaml"]) > 20
    assert "gpuwatchd_gpu_power_watts" in found["gpuwatchd/health/hangs/gpu.py"]
    assert "gpuwatchd:node_health:max" in recorded_names()


@pytest.mark.parametrize(("path", "names"), consumers(), ids=[p for p, _ in consumers()])
def test_every_metric_read_is_produced(path: str, names: set[str]) -> None:
    assert unproduced(names, produced()) == [], f"{path} reads metrics no MetricSpec produces"


def test_contract_check_can_fail() -> None:
    have = {"gpuwatchd_gpu_power_watts", "gpuwatchd_infiniband_state_id", "gpuwatchd:x:rate5m"}
    text = "rate(gpuwatchd_gpu_power_watt[5m]) + gpuwatchd:x:rate5m + on() gpuwatchd_shm_"
    assert unproduced(names_in_text(text), have) == [
        "gpuwatchd_gpu_power_watt",
        "gpuwatchd_shm_*",
    ]
    source = 'IB = "gpuwatchd_infiniband_"\nX = "gpuwatchd_infiniband_state_id"\nY = "no_metric"\n'
    assert names_in_python(source) == {"gpuwatchd_infiniband_", "gpuwatchd_infiniband_state_id"}
    assert unproduced(names_in_python(source), have) == []
