"""Xid tracker: bursts, defaults that page (or not), holds, clears, resets, escalation."""

from __future__ import annotations

import pytest

from gpuwatchd import config
from gpuwatchd.health.xid import catalog as xid
from gpuwatchd.health.xid.tracker import Policy, TrackerSettings, XidTracker
from gpuwatchd.model import Action, Clear, Event, Severity

T0 = 1_700_000_000.0
BUS = "0000:00:06.0"
BOOT = "boot-a"


def ev(code: int, t: float = T0, bus: str = BUS, kind: str = "xid", **attrs: str) -> Event:
    base = {"gpu": "0", "uuid": "GPU-544a204b", "boot_id": BOOT, "detail": attrs.pop("detail", "")}
    base.update(attrs)
    return Event(
        kind=kind,
        source="kmsg",
        time=t,
        code=code,
        pci_bus_id=bus,
        attrs=tuple(sorted((k, v) for k, v in base.items() if v)),
    )


def tracker(settings: TrackerSettings | None = None, boot: str = BOOT) -> XidTracker:
    return XidTracker(xid.default_catalog(), settings or TrackerSettings(), boot)


def active_codes(t: XidTracker, now: float) -> dict[int, tuple[str, str]]:
    return {a.code: (str(a.info.severity), str(a.info.action)) for a in t.active(now)}


def test_a_storm_is_one_event_with_a_count() -> None:
    t = tracker()
    kinds = [t.observe(ev(95, T0 + i * 0.01)).kind for i in range(1000)]
    assert kinds.count("new") == 1 and kinds.count("repeat") == 999
    obs = t.observe(ev(95, T0 + 10.0))
    assert (obs.kind, obs.count) == ("repeat", 1001)
    assert t.observe(ev(95, T0 + 200.0)).kind == "new"  # quiet for > burst window
    total = [s for s in t.samples(T0 + 200) if s.name == "gpuwatchd_xid_errors_total"]
    assert [s.value for s in total] == [1002.0]


def test_same_code_on_two_gpus_is_two_conditions() -> None:
    t = tracker()
    assert t.observe(ev(79, bus="0000:00:06.0")).kind == "new"
    assert t.observe(ev(79, bus="0000:00:07.0")).kind == "new"
    assert len(t.active(T0)) == 2


@pytest.mark.parametrize("code", [13, 31, 43, 45, 63, 92, 94])
def test_application_xids_do_not_page(code: int) -> None:
    t = tracker()
    t.observe(ev(code))
    assert all(a.info.severity < Severity.CRITICAL for a in t.active(T0))


@pytest.mark.parametrize("code", [48, 64, 74, 79, 95, 109, 119, 120])
def test_hardware_xids_page_until_something_fixes_them(code: int) -> None:
    t = tracker()
    t.observe(ev(code))
    assert active_codes(t, T0 + 7 * 86400)[code][0] == "critical"


def test_xid154_pages_only_when_a_reset_or_reboot_is_required() -> None:
    t = tracker()
    t.observe(ev(154, recovery_action="Drain P2P", previous_recovery_action="None"))
    assert active_codes(t, T0) == {154: ("warning", "drain_and_inspect")}
    t.observe(
        ev(154, T0 + 1, recovery_action="GPU Reset Required", previous_recovery_action="Drain P2P")
    )
    assert active_codes(t, T0 + 3600) == {154: ("critical", "reset_gpu")}


def test_warning_holds_then_clears_and_info_is_never_active() -> None:
    t = tracker(TrackerSettings(warning_hold=600))
    t.observe(ev(13))
    t.observe(ev(43))
    assert set(active_codes(t, T0 + 599)) == {13}
    assert active_codes(t, T0 + 601) == {}
    samples = {(s.name, s.label("xid")): s.value for s in t.samples(T0 + 601)}
    assert samples[("gpuwatchd_xid_active", "13")] == 0
    assert samples[("gpuwatchd_xid_errors_total", "43")] == 1


def test_operator_clear_ends_a_sticky_condition_until_it_comes_back() -> None:
    t = tracker()
    t.observe(ev(79))
    assert t.clear(Clear(time=T0 + 5, who="alice", pci_bus_id=BUS, code=79)) == 1
    assert active_codes(t, T0 + 6) == {}
    t.observe(ev(79, T0 + 10))
    assert 79 in active_codes(t, T0 + 11)


def test_clear_is_scoped() -> None:
    t = tracker()
    t.observe(ev(79, bus="0000:00:06.0"))
    t.observe(ev(48, bus="0000:00:07.0"))
    t.clear(Clear(time=T0 + 1, who="bob", pci_bus_id="0000:00:07.0"))
    assert [(a.pci_bus_id, a.code) for a in t.active(T0 + 2)] == [("0000:00:06.0", 79)]


def test_gpu_reset_clears_what_a_reset_fixes_only() -> None:
    t = tracker()
    t.observe(ev(48))  # reset_gpu
    t.observe(ev(79))  # reboot_node: a reset does not bring a GPU back on the bus
    t.gpu_reset(BUS, T0 + 60)
    assert set(active_codes(t, T0 + 61)) == {79}
    assert t.active(T0 + 61)[0].until == "reboot or operator clear"


def test_xid154_back_to_none_means_the_gpu_was_reset() -> None:
    t = tracker()
    t.observe(ev(48))
    t.observe(
        ev(154, T0 + 1, recovery_action="GPU Reset Required", previous_recovery_action="None")
    )
    assert set(active_codes(t, T0 + 2)) == {48, 154}
    t.observe(
        ev(154, T0 + 100, recovery_action="None", previous_recovery_action="GPU Reset Required")
    )
    assert active_codes(t, T0 + 101) == {}


def test_threshold_policy_needs_n_reports_in_the_window() -> None:
    s = TrackerSettings(policies={("xid", 13): Policy(threshold=3, window=60)})
    t = tracker(s)
    assert not t.observe(ev(13, T0)).raised
    assert not t.observe(ev(13, T0 + 100)).raised  # the first one fell out of the window
    assert not t.observe(ev(13, T0 + 110)).raised
    assert t.observe(ev(13, T0 + 120)).raised
    assert 13 in active_codes(t, T0 + 121)


def test_ignore_policy_counts_but_never_raises() -> None:
    s = TrackerSettings(policies={("xid", 79): Policy(ignore=True)})
    t = tracker(s)
    obs = t.observe(ev(79))
    assert not obs.raised and obs.event.attr("policy") == "ignored by site policy"
    assert active_codes(t, T0) == {}
    assert any(s.name == "gpuwatchd_xid_errors_total" and s.value == 1 for s in t.samples(T0))


def test_hold_policy() -> None:
    t = tracker(TrackerSettings(policies={("xid", 43): Policy(hold=30)}))
    t.observe(ev(43))
    assert 43 in active_codes(t, T0 + 29)
    assert 43 not in active_codes(t, T0 + 31)


def test_settings_from_config() -> None:
    cfg = config.load_text(
        "xid:\n  burst_window: 5\n  overrides:\n    45: {ignore: true}\n    13: {threshold: 4}\n"
    )
    s = TrackerSettings.from_config(cfg)
    assert s.burst_window == 5
    assert s.policy("xid", 45).ignore and s.policy("xid", 13).threshold == 4
    assert s.policy("xid", 79) == Policy()


def test_escalation_after_resets_in_one_boot() -> None:
    t = tracker()
    assert t.observe(ev(48, T0)).info.action is Action.RESET_GPU
    t.gpu_reset(BUS, T0 + 100)
    assert t.observe(ev(48, T0 + 200)).info.action is Action.RESET_GPU
    t.gpu_reset(BUS, T0 + 300)
    third = t.observe(ev(48, T0 + 400))
    assert third.info.action is Action.DRAIN_AND_INSPECT
    assert "3 boots or GPU resets" in third.event.attr("escalated")
    active = t.active(T0 + 401)
    assert [(a.code, str(a.info.action), a.escalated) for a in active] == [
        (48, "drain_and_inspect", True)
    ]


def test_escalation_across_reboots_from_stored_history() -> None:
    old = [
        ev(79, T0 - 2 * 86400, boot_id="boot-1", epoch="boot-1#0"),
        ev(79, T0 - 86400, boot_id="boot-2", epoch="boot-2#0"),
    ]
    t = tracker(boot="boot-3")
    t.restore(old)
    assert t.active(T0) == []  # other boots: history only, nothing active
    obs = t.observe(ev(79, T0, boot_id="boot-3"))
    assert obs.info.action is Action.DRAIN_AND_INSPECT


def test_escalation_forgets_old_history_and_can_be_off() -> None:
    old = [ev(79, T0 - 90 * 86400, boot_id=f"b{i}", epoch=f"b{i}#0") for i in range(5)]
    t = tracker(TrackerSettings(escalate_window=30 * 86400), boot="now")
    t.restore(old)
    assert t.observe(ev(79, T0, boot_id="now")).info.action is Action.REBOOT_NODE
    off = tracker(TrackerSettings(escalate_after=0))
    for i in range(5):
        off.observe(ev(48, T0 + i * 1000))
        off.gpu_reset(BUS, T0 + i * 1000 + 1)
    assert off.observe(ev(48, T0 + 9000)).info.action is Action.RESET_GPU


def test_restore_brings_back_this_boots_conditions_and_clears() -> None:
    first = tracker()
    stored = [
        first.observe(ev(79, T0)).event,
        first.observe(ev(48, T0 + 1, bus="0000:00:07.0")).event,
    ]
    again = tracker()
    again.restore(stored, [Clear(time=T0 + 5, who="alice", pci_bus_id="0000:00:07.0")])
    assert [(a.pci_bus_id, a.code) for a in again.active(T0 + 10)] == [("0000:00:06.0", 79)]
    # restoring does not count reports a second time
    assert not [s for s in again.samples(T0) if s.name == "gpuwatchd_xid_errors_total"]


def test_a_nonfatal_report_does_not_hide_an_active_fatal_one() -> None:
    t = tracker()
    t.observe(ev(149, T0, detail="NETIR_LINK_EVT Fatal XC0 i0 Link 01 (0x021425c6 0x0)"))
    t.observe(ev(149, T0 + 1, detail="NETIR_LINK_EVT Nonfatal XC0 i0 Link 01 (0x021425c6)"))
    assert active_codes(t, T0 + 3600) == {149: ("critical", "reset_gpu")}


def test_samples_have_the_promised_labels() -> None:
    t = tracker()
    t.observe(ev(79))
    t.observe(ev(12028, kind="sxid", bus="0000:84:00.0", fatal="true"))
    by_name = {s.name: dict(s.labels) for s in t.samples(T0)}
    assert by_name["gpuwatchd_xid_active"] == {
        "gpu": "0",
        "uuid": "GPU-544a204b",
        "pci_bus_id": BUS,
        "xid": "79",
        "name": "GPU has fallen off the bus",
        "severity": "critical",
        "action": "reboot_node",
    }
    assert set(by_name["gpuwatchd_xid_errors_total"]) == set(by_name["gpuwatchd_xid_active"])
    assert by_name["gpuwatchd_xid_last_seen_timestamp_seconds"] == {
        "gpu": "0",
        "uuid": "GPU-544a204b",
        "xid": "79",
    }
    assert by_name["gpuwatchd_sxid_active"] == {
        "pci_bus_id": "0000:84:00.0",
        "sxid": "12028",
        "name": "egress nonposted PRIV error",
        "severity": "critical",
        "action": "reboot_node",
    }
    assert by_name["gpuwatchd_sxid_last_seen_timestamp_seconds"] == {
        "pci_bus_id": "0000:84:00.0",
        "sxid": "12028",
    }
    from gpuwatchd.health.xid.tracker import METRICS

    specs = {m.name: m for m in METRICS}
    for s in t.samples(T0):
        assert set(dict(s.labels)) == set(specs[s.name].labels), s.name


def test_classified_event_carries_name_action_and_burst() -> None:
    obs = tracker().observe(ev(31, pid="650", process="python3"))
    e = obs.event
    assert e.severity is Severity.WARNING
    assert (e.attr("name"), e.attr("action"), e.attr("pid")) == (
        "GPU memory page fault",
        "restart_app",
        "650",
    )
    assert e.attr("burst_id") == obs.burst_id and e.attr("epoch") == f"{BOOT}#0"
