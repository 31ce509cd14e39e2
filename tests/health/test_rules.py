"""Table-driven tests of the health rules over snapshots cut from a real H200 baseline."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from gpuwatchd.config import Config, HealthConfig
from gpuwatchd.health import rules, ruleset
from gpuwatchd.health.history import History, View
from gpuwatchd.health.rules import ALERTS, Inputs, XidCondition
from gpuwatchd.model import Action, Finding, Severity
from tests.health.snapshots import GPU0, GPU1, T0, Node

U0, U1 = GPU0["uuid"], GPU1["uuid"]


def cfg_with(**health: object) -> Config:
    return dataclasses.replace(Config(), health=dataclasses.replace(HealthConfig(), **health))


def run(
    steps: Sequence[Node],
    cfg: Config | None = None,
    xids: Sequence[XidCondition] = (),
    dt: float = 10.0,
) -> list[Finding]:
    """Feed each node state as one poll, `dt` apart; findings of the last evaluation."""
    cfg = cfg or Config()
    hist = History(cfg.health.rate_window_seconds)
    found: list[Finding] = []
    for i, node in enumerate(steps):
        now = T0 + i * dt
        view = View(node.snapshot(now))
        hist.observe(view, now)
        found = ruleset.evaluate(Inputs(view, hist, cfg, now, xids))
    return found


def ids(found: Sequence[Finding]) -> set[tuple[str, str]]:
    out = set()
    for f in found:
        s = dict(f.subject)
        out.add(
            (
                f.alertname,
                s.get("gpu")
                or s.get("collector")
                or "/".join(filter(None, (s.get("device"), s.get("port"))))
                or "node",
            )
        )
    return out


def node(
    g0: dict[str, float] | None = None, g1: dict[str, float] | None = None, **kw: object
) -> Node:
    return Node(gpus={U0: g0 or {}, U1: g1 or {}}, **kw)  # type: ignore[arg-type]


def xid(
    code: int, severity: Severity, action: Action, bus: str = "0000:00:06.0", kind: str = "xid"
) -> XidCondition:
    return XidCondition(
        code=code,
        pci_bus_id=bus,
        severity=severity,
        action=action,
        name=f"code {code}",
        remediation="do the thing",
        since=T0 - 5,
        kind=kind,
    )


CASES = [
    # id, steps, cfg, xids, expected
    ("healthy", [node(), node()], None, (), set()),
    (
        "ecc uncorrectable rises",
        [node(), node({"ecc_unc_vol": 1, "ecc_unc_agg": 1})],
        None,
        (),
        {("GpuEccUncorrectable", "0")},
    ),
    (
        "ecc already nonzero at start is not a rise",
        [node({"ecc_unc_agg": 7}), node({"ecc_unc_agg": 7})],
        None,
        (),
        set(),
    ),
    (
        "ecc hold expires",
        [node(), node({"ecc_unc_vol": 1})] + [node({"ecc_unc_vol": 1})] * 3,
        cfg_with(ecc_hold_seconds=15.0),
        (),
        set(),
    ),
    (
        "ecc after reset counts",
        [node({"ecc_unc_vol": 4}), node({"ecc_unc_vol": 1})],
        None,
        (),
        {("GpuEccUncorrectable", "0")},
    ),
    ("row remap failure", [node(g1={"remap_failure": 1})], None, (), {("GpuRowRemapFailure", "1")}),
    ("row remap pending", [node({"remap_pending": 1})], None, (), {("GpuRowRemapPending", "0")}),
    (
        "retired pages pending (older GPU)",
        [node({"retired_pending": 1})],
        None,
        (),
        {("GpuRowRemapPending", "0")},
    ),
    (
        "nvlink down that was up",
        [node(), node({"link3_up": 0})],
        None,
        (),
        {("GpuNvlinkDown", "0")},
    ),
    (
        "nvlink never up is not an alert",
        [node({"link3_up": 0}), node({"link3_up": 0})],
        None,
        (),
        set(),
    ),
    (
        "nvlink errors fast",
        [node({"link3_crc": 2}), node({"link3_crc": 100})],
        None,
        (),
        {("GpuNvlinkErrors", "0")},
    ),
    # DCGM's health watch fails on any rise of replay, recovery or CRC (nvidia-smi nvlink -e)
    (
        "nvlink one crc error",
        [node({"link3_crc": 2}), node({"link3_crc": 3})],
        None,
        (),
        {("GpuNvlinkErrors", "0")},
    ),
    ("nvlink crc unchanged", [node({"link3_crc": 2}), node({"link3_crc": 2})], None, (), set()),
    (
        "nvlink errors below a configured rate",
        [node({"link3_crc": 2}), node({"link3_crc": 20})],
        cfg_with(nvlink_error_rate=0.1),
        (),
        set(),
    ),
    # a 2x H100 under DDP training: 62,825 ECC-corrected in 40 s, nvidia-smi read 0 errors
    (
        "nvlink corrected errors under load",
        [node({"link3_ecc": 4}), node({"link3_ecc": 62_829})],
        None,
        (),
        set(),
    ),
    ("temperature near slowdown", [node({"temp": 85})], None, (), {("GpuTemperatureHigh", "0")}),
    ("temperature below margin", [node({"temp": 83})], None, (), set()),
    (
        "memory temperature near max",
        [node(g1={"mem_temp": 92})],
        None,
        (),
        {("GpuTemperatureHigh", "1")},
    ),
    ("hw slowdown active", [node({"hw_slowdown": 1})], None, (), {("GpuThermalSlowdown", "0")}),
    (
        "hw slowdown not configured",
        [node({"hw_slowdown": 1})],
        cfg_with(slowdown_reasons=["hw_power_brake_slowdown"]),
        (),
        set(),
    ),
    ("pcie width degraded", [node({"width": 8})], None, (), {("GpuPcieDegraded", "0")}),
    ("pcie gen low while idle is normal", [node({"gen": 1})], None, (), set()),
    (
        "pcie gen low while busy",
        [node({"gen": 3, "util": 0.9})],
        None,
        (),
        {("GpuPcieDegraded", "0")},
    ),
    (
        "pcie replays rising",
        [node({"replays": 0}), node({"replays": 500})],
        None,
        (),
        {("GpuPcieDegraded", "0")},
    ),
    (
        "recovery action set",
        [node(g1={"recovery": 2})],
        None,
        (),
        {("GpuRecoveryActionRequired", "1")},
    ),
    ("gpu lost state", [node({"nvml_state": 2})], None, (), {("GpuLost", "0")}),
    ("gpu unresponsive", [node({"nvml_state": 1})], None, (), {("NvmlUnresponsive", "0")}),
    (
        "gpu disappears",
        [node(), Node(gpus={U0: {}})],
        None,
        (),
        {("GpuLost", "1"), ("GpuCountLow", "node")},
    ),
    (
        "expected gpus from config",
        [Node(gpus={U0: {}})],
        cfg_with(expected_gpus=8),
        (),
        {("GpuCountLow", "node")},
    ),
    (
        "nvml down with gpus expected",
        [node(), Node(nvml_ok=False, nvml_error="driver_not_loaded")]
        + [Node(nvml_ok=False, nvml_error="driver_not_loaded")] * 13,
        None,
        (),
        {("NvmlUnresponsive", "node")},
    ),
    (
        "nvml down on a gpu-less node",
        [Node(gpus={}, nvml_ok=False, nvml_error="lib")] * 14,
        None,
        (),
        {("GpuwatchdCollectorFailed", "nvml")},
    ),
    (
        "collector failing briefly",
        [node(extra_sources={"shm": []}, failing={"shm": "io"})] * 3,
        None,
        (),
        set(),
    ),
    (
        "xid critical",
        [node()],
        None,
        [xid(79, Severity.CRITICAL, Action.REBOOT_NODE)],
        {("GpuXidCritical", "0")},
    ),
    (
        "xid warning on 2nd gpu (NVML-style bus id)",
        [node()],
        None,
        [xid(31, Severity.WARNING, Action.RESTART_APP, bus="00000000:00:07.0")],
        {("GpuXidWarning", "1")},
    ),
    ("xid info is no finding", [node()], None, [xid(43, Severity.INFO, Action.NONE)], set()),
    (
        "xid on unknown gpu keeps bus id",
        [node()],
        None,
        [xid(48, Severity.CRITICAL, Action.RESET_GPU, bus="0000:9a:00.0")],
        {("GpuXidCritical", "node")},
    ),
    (
        "sxid critical",
        [node()],
        None,
        [xid(12028, Severity.CRITICAL, Action.REBOOT_NODE, bus="0000:05:00.0", kind="sxid")],
        {("NvswitchSxidCritical", "node")},
    ),
    (
        "disabled rule",
        [node({"width": 8})],
        cfg_with(disabled_rules=["GpuPcieDegraded"]),
        (),
        set(),
    ),
]


@pytest.mark.parametrize(
    ("steps", "cfg", "xids", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rule_table(
    steps: list[Node], cfg: Config | None, xids: list[XidCondition], expected: set[tuple[str, str]]
) -> None:
    assert ids(run(steps, cfg, xids)) == expected


def test_findings_carry_catalog_and_alert_facts() -> None:
    [f] = run([node()], xids=[xid(79, Severity.CRITICAL, Action.REBOOT_NODE)])
    assert f.severity is Severity.CRITICAL and f.action is Action.REBOOT_NODE
    assert f.remediation == "do the thing" and f.since == T0 - 5
    assert dict(f.subject) == GPU0 and dict(f.labels) == {
        "xid": "79",
        "name": "code 79",  # for the alert's description, not a label
        "incident": "xid-0000:00:06.0-79",  # shared with a hang it caused
    }
    assert rules.summary(f) == "Critical Xid 79 on GPU 0"
    [e] = run([node(), node({"ecc_unc_vol": 3})])
    assert "rose from 0 to 3" in e.reason and e.remediation == ALERTS[e.alertname].remediation


def test_every_alert_has_a_runbook_and_summary() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "docs" / "runbooks"
    for name, info in ALERTS.items():
        assert (root / f"{name}.md").is_file(), name
        assert info.summary and info.component


def test_counter_reset_is_not_negative() -> None:
    hist = History(300)
    key = ("gpuwatchd_nvlink_errors_total", (("link", "0"),))
    for i, v in enumerate([100, 150, 10, 30]):
        hist._add_point(key, T0 + i * 10, v)
    assert hist.increase(*key, T0 + 30) == 50 + 10 + 20
