"""The Xid catalog: shipped data, compact form, lookups, line overrides, site overrides."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpuwatchd import config
from gpuwatchd.config import XidRule
from gpuwatchd.errors import CatalogError, ConfigError
from gpuwatchd.health.xid import catalog as xid
from gpuwatchd.model import Action, Severity

ROOT = Path(__file__).resolve().parent.parent.parent
DATA = ROOT / "gpuwatchd" / "data"
sys.path.insert(0, str(ROOT / "scripts"))
import build_catalog  # noqa: E402


def test_compact_json_matches_the_yaml() -> None:
    # the shipped JSON is generated: python scripts/build_catalog.py
    assert (DATA / "xid-catalog.json").read_text() == build_catalog.render()


def test_yaml_and_json_load_to_the_same_catalog() -> None:
    full = xid.load_catalog(str(DATA / "xid-catalog.yaml"))
    compact = xid.default_catalog()
    for kind in ("xid", "sxid"):
        assert full.codes(kind) == compact.codes(kind)
        for code in full.codes(kind):
            assert full.lookup(code, kind) == compact.lookup(code, kind)
    assert len(compact.codes("xid")) == 173 and len(compact.codes("sxid")) == 398


def test_cli_start_pays_no_yaml() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); "
        "from gpuwatchd.health.xid import catalog as xid; xid.default_catalog(); "
        "print(time.perf_counter() - t, 'yaml' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[1] == "False"  # the cost itself is measured in benchmarks, not asserted here


NO_PAGE = [13, 31, 43, 45, 63, 92, 94]
PAGE = [48, 64, 74, 79, 95, 109, 119, 120]


@pytest.mark.parametrize("code", NO_PAGE)
def test_application_codes_do_not_page(code: int) -> None:
    assert xid.lookup(code).severity < Severity.CRITICAL


@pytest.mark.parametrize("code", PAGE)
def test_hardware_and_driver_codes_page(code: int) -> None:
    info = xid.lookup(code)
    assert info.severity is Severity.CRITICAL
    assert info.action in (Action.RESET_GPU, Action.REBOOT_NODE, Action.DRAIN_AND_INSPECT)


@pytest.mark.parametrize(
    ("recovery", "severity", "action"),
    [
        ("None", Severity.INFO, Action.NONE),
        ("Drain P2P", Severity.WARNING, Action.DRAIN_AND_INSPECT),
        ("Drain and Reset", Severity.CRITICAL, Action.RESET_GPU),
        ("GPU Reset Required", Severity.CRITICAL, Action.RESET_GPU),
        ("Node Reboot Required", Severity.CRITICAL, Action.REBOOT_NODE),
    ],
)
def test_xid154_follows_its_recovery_action(
    recovery: str, severity: Severity, action: Action
) -> None:
    info = xid.default_catalog().resolve(154, recovery_action=recovery)
    assert (info.severity, info.action) == (severity, action)


@pytest.mark.parametrize(
    ("code", "text", "severity", "action"),
    [
        (
            144,
            "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008)",
            Severity.WARNING,
            Action.NONE,
        ),
        (
            149,
            "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x0)",
            Severity.CRITICAL,
            Action.RESET_GPU,
        ),
        (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2)", Severity.WARNING, Action.NONE),
    ],
)
def test_nvlink5_trusts_the_line(code: int, text: str, severity: Severity, action: Action) -> None:
    info = xid.default_catalog().resolve(code, text=text)
    assert (info.severity, info.action) == (severity, action)


def test_sxid_line_severity() -> None:
    cat = xid.default_catalog()
    assert cat.lookup(20012, "sxid").severity is Severity.CRITICAL
    assert cat.resolve(20012, "sxid", fatal=False).severity is Severity.WARNING
    assert cat.lookup(22013, "sxid").severity is Severity.INFO
    fatal = cat.resolve(22013, "sxid", fatal=True)
    assert fatal.severity is Severity.CRITICAL and fatal.action is Action.REBOOT_NODE


def test_unknown_codes_are_a_clear_warning() -> None:
    info = xid.lookup(9999)
    assert (info.name, info.severity, info.known, info.code) == (
        "Unknown Xid",
        Severity.WARNING,
        False,
        9999,
    )
    assert xid.lookup(1, "sxid").name == "Unknown SXid"
    assert "not in the catalog" in info.remediation


def test_site_overrides_from_config() -> None:
    cfg = config.load_text(
        """
xid:
  overrides:
    13: {severity: critical, action: reset_gpu}
    200: {name: Site specific code, severity: info, remediation: Ignore on our cluster.}
    145: {severity: critical}
  sxid_overrides:
    22013: {severity: warning}
"""
    )
    cat = xid.from_config(cfg)
    assert (cat.lookup(13).severity, cat.lookup(13).action) == (Severity.CRITICAL, Action.RESET_GPU)
    site = cat.lookup(200)
    assert (site.name, site.known, site.remediation) == (
        "Site specific code",
        True,
        "Ignore on our cluster.",
    )
    # the site decided: a Nonfatal line no longer lowers 145
    assert cat.resolve(145, text="RLW_RXPIPE Nonfatal").severity is Severity.CRITICAL
    assert cat.lookup(22013, "sxid").severity is Severity.WARNING
    assert xid.default_catalog().lookup(13).severity is Severity.WARNING  # shared one untouched


def test_bad_override_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as exc:  # refused when loading, by `config check` too
        config.load_text("xid:\n  overrides:\n    thirteen: {severity: critical}\n")
    assert exc.value.key == "xid.overrides.thirteen"
    cfg = config.read(None)
    cfg = dataclasses.replace(cfg, xid=dataclasses.replace(cfg.xid, overrides={"x": XidRule()}))
    with pytest.raises(ConfigError) as exc:
        xid.from_config(cfg)
    assert exc.value.key == "xid.overrides.x"


def _minimal() -> dict:
    data = json.loads((DATA / "xid-catalog.json").read_text())
    data["xid"] = data["xid"][:3]
    data["sxid"] = []
    return data


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["xid"][0].update(severity="fatal"), "xid[0]"),
        (lambda d: d["xid"][1].update(action="pray"), "xid[1]"),
        (lambda d: d["xid"][2].pop("name"), "xid[2]: missing field name"),
        (lambda d: d["xid"][2].update(code=1), "duplicate code 1"),
        (lambda d: d["xid"][0].update(category="cosmic"), "unknown category"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["actions"].pop("reset_gpu"), "no text for reset_gpu"),
        (lambda d: d.pop("unknown_code"), "unknown_code"),
    ],
)
def test_a_bad_catalog_names_its_key(mutate, message: str) -> None:
    data = _minimal()
    mutate(data)
    with pytest.raises(CatalogError) as exc:
        xid.build(data)
    assert message in str(exc.value)


def test_full_yaml_validates_too() -> None:
    t = time.perf_counter()
    with open(DATA / "xid-catalog.yaml") as f:
        data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    xid.build(data)
    assert time.perf_counter() - t < 5
