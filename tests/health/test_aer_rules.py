"""PCIe AER rules over real polls of the aer source on copies of the fixture sysfs tree."""

from __future__ import annotations

import shutil
from pathlib import Path

from gpuwatchd.config import load_text
from gpuwatchd.health.aer_rules import AerRules, AerThresholds
from gpuwatchd.health.alerts import ALERTS, summary
from gpuwatchd.health.node_rules import NodeRules
from gpuwatchd.model import Action, Finding, Sample, Severity, SourceSnapshot
from gpuwatchd.sources.aer.source import AerSource
from gpuwatchd.state import NodeSnapshot

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sys"
GPU0 = "pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0/0000:19:00.0"
SWITCH_UP = "pci0000:16/0000:16:01.0/0000:17:00.0"
ROOT_9A = "pci0000:9a/0000:9a:01.0"  # kernel 4.19 names


class Rig:
    """A copy of the fixture tree, the source over it and the rules over the source."""

    def __init__(self, tmp_path: Path, thresholds: AerThresholds | None = None) -> None:
        self.root = tmp_path / "sys"
        shutil.copytree(FIXTURE, self.root, symlinks=True)
        self.source = AerSource(str(self.root))
        self.rules = AerRules(thresholds)

    def poll(self, now: float) -> list[Finding]:
        samples = [s for s in self.source.poll(now) if isinstance(s, Sample)]
        return self.rules.update(samples, now)

    def bump(self, dev: str, fname: str, **by: int) -> None:
        """Raise some counters of an aer_dev_* file by the given amounts."""
        path = self.root / "devices" / dev / fname
        lines = []
        for line in path.read_text().splitlines():
            name, _, value = line.rpartition(" ")
            lines.append(f"{name} {int(value) + by.get(name.replace(' ', '_'), 0)}")
        path.write_text("\n".join(lines) + "\n")


def names(found: list[Finding]) -> list[tuple[str, str]]:
    return [(f.alertname, dict(f.subject)["pci_bus_id"]) for f in found]


def test_quiet_counters_and_old_errors_fire_nothing(tmp_path: Path) -> None:
    rig = Rig(tmp_path)  # root port 9a:01.0 already counts 2 correctable errors
    for t in range(0, 600, 30):
        assert rig.poll(float(t)) == []


def test_fatal_error_at_a_gpu_is_critical_and_names_the_type(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.poll(0.0)
    rig.bump(GPU0, "aer_dev_fatal", SDES=1, TOTAL_ERR_FATAL=1)
    found = rig.poll(30.0)
    assert names(found) == [("PcieAerFatalErrors", "0000:19:00.0")]
    f = found[0]
    assert f.severity is Severity.CRITICAL and f.action is Action.DRAIN_AND_INSPECT
    assert dict(f.labels) == {"role": "gpu"}
    assert "SDES +1" in f.reason and "GPU 0000:19:00.0" in f.reason
    assert f.remediation
    assert summary(f) == "Fatal PCIe errors at gpu 0000:19:00.0"
    assert set(ALERTS[f.alertname].labels) == {k for k, _ in (*f.subject, *f.labels)}


def test_fatal_error_holds_for_hold_seconds_then_resolves(tmp_path: Path) -> None:
    rig = Rig(tmp_path, AerThresholds(hold_seconds=600.0))
    rig.poll(0.0)
    rig.bump(GPU0, "aer_dev_fatal", TOTAL_ERR_FATAL=1)
    assert rig.poll(30.0)
    for t in range(60, 631, 30):
        assert names(rig.poll(float(t))) == [("PcieAerFatalErrors", "0000:19:00.0")], t
    assert rig.poll(660.0) == []


def test_non_fatal_error_at_a_switch_port_is_a_warning_naming_what_is_below(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    rig.poll(0.0)
    rig.bump(SWITCH_UP, "aer_dev_nonfatal", CmpltTO=2, TOTAL_ERR_NONFATAL=2)
    found = rig.poll(30.0)
    assert names(found) == [("PcieAerNonFatalErrors", "0000:17:00.0")]
    f = found[0]
    assert f.severity is Severity.WARNING and dict(f.labels) == {"role": "bridge"}
    assert "CmpltTO +2" in f.reason
    assert "above GPUs 0000:19:00.0,0000:1b:00.0 and mlx5_0" in f.reason


def test_a_reset_counter_counts_its_new_value_as_the_rise(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.bump(GPU0, "aer_dev_fatal", TOTAL_ERR_FATAL=3)
    rig.poll(0.0)
    path = rig.root / "devices" / GPU0 / "aer_dev_fatal"
    path.write_text(path.read_text().replace("TOTAL_ERR_FATAL 3", "TOTAL_ERR_FATAL 1"))
    assert names(rig.poll(30.0)) == [("PcieAerFatalErrors", "0000:19:00.0")]


def test_correctable_errors_fire_only_above_the_floor_over_the_window(tmp_path: Path) -> None:
    # floor 8/min over 300 s: more than 40 in the window
    rig = Rig(tmp_path)
    rig.poll(0.0)
    for t in range(30, 301, 30):  # 4 per 30 s = 8/min: at the floor, not above it
        rig.bump(GPU0, "aer_dev_correctable", RxErr=4, TOTAL_ERR_COR=4)
        assert rig.poll(float(t)) == [], t
    rig.bump(GPU0, "aer_dev_correctable", BadTLP=6, TOTAL_ERR_COR=6)
    found = rig.poll(330.0)
    assert names(found) == [("PcieAerCorrectableErrorsRising", "0000:19:00.0")]
    assert found[0].severity is Severity.WARNING and "rose by 42" in found[0].reason
    for t in range(360, 661, 30):  # quiet again: the burst leaves the window
        found = rig.poll(float(t))
    assert found == []


def test_a_short_burst_under_the_window_budget_does_not_fire(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.poll(0.0)
    rig.bump(ROOT_9A, "aer_dev_correctable", Receiver_Error=30, TOTAL_ERR_COR=30)
    assert rig.poll(30.0) == []  # 30 in 30 s, but 30 in 5 min is under 8/min


def test_node_rules_run_the_aer_rules_on_new_aer_polls_only(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    cfg = load_text("sources: {aer: {hold_seconds: 60}}\n")
    node = NodeRules(cfg)

    def snap(t: float) -> NodeSnapshot:
        samples = tuple(s for s in rig.source.poll(t) if isinstance(s, Sample))
        return NodeSnapshot(sources={"aer": SourceSnapshot("aer", samples, True, timestamp=t)})

    assert node.evaluate(snap(0.0)) == []
    rig.bump(GPU0, "aer_dev_fatal", TOTAL_ERR_FATAL=1)
    first = snap(30.0)
    assert [f.alertname for f in node.evaluate(first)] == ["PcieAerFatalErrors"]
    assert [f.alertname for f in node.evaluate(first)] == ["PcieAerFatalErrors"]  # same poll
    assert node.evaluate(snap(60.0)) != []
    assert node.evaluate(snap(120.0)) == []  # hold_seconds from config
