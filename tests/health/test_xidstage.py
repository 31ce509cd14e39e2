"""Source -> state -> pipeline -> store, with a restart in the middle: no duplicate, no miss."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import (
    Config,
    DaemonConfig,
    KmsgConfig,
    NvmlConfig,
    PathsConfig,
    SourcesConfig,
)
from gpuwatchd.health.xid.stage import METRICS, XidStage
from gpuwatchd.model import Event, SourceSnapshot
from gpuwatchd.sinks.store import EventStore
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import State

BOOT = "9d1f6a0e-1111-4222-8333-444455556666"


def raw(seq: int, msg: str, usec: int | None = None) -> str:
    return f"3,{seq},{seq * 1_000_000 if usec is None else usec},-;{msg}\n"


def xid(code: int, bus: str = "0000:00:06", pid: int = 650) -> str:
    return f"NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name=python3, detail {code}"


class Node:
    """One daemon's worth of pipeline: state, store, source, runner."""

    def __init__(self, tmp: Path, clock: FakeClock, replay: str = "") -> None:
        (tmp / "proc").mkdir(exist_ok=True)
        (tmp / "boot_id").write_text(BOOT + "\n")
        self.cfg = Config(
            paths=PathsConfig(
                kmsg=str(tmp / "kmsg"), boot_id=str(tmp / "boot_id"), procfs=str(tmp / "proc")
            ),
            daemon=DaemonConfig(state_dir=str(tmp / "state")),
            sources=SourcesConfig(kmsg=KmsgConfig(backend="kmsg"), nvml=NvmlConfig(replay=replay)),
        )
        self.clock = clock
        self.state = State()
        self.store = EventStore.from_config(self.cfg, clock.time)
        self.stage = XidStage.from_config(self.cfg, self.state.publish_extra, self.store, clock)
        self.state.subscribe(self.stage.on_publish)
        ctx = SourceContext(clock=clock, load_cursor=self.store.load_cursor)
        self.source = KmsgSource(self.cfg, ctx, wait=0.01, sleep=lambda s: None)
        self.runner = Runner([self.source], self.state, clock)

    def poll(self) -> None:
        self.runner.poll_once("kmsg")

    def active(self) -> dict[tuple[str, str], float]:
        xs = self.state.snapshot().extra.get("xid", ())
        return {
            (s.label("xid"), s.label("pci_bus_id")): s.value
            for s in xs
            if s.name == "gpuwatchd_xid_active"
        }

    def stop(self) -> None:
        self.source.close()
        self.store.close()


def stored(node: Node) -> list[tuple[int, int]]:
    return sorted((r["code"], r["sequence"]) for r in node.store.recent(1000))


def test_restart_keeps_events_once_and_state(tmp_path: Path) -> None:
    clock = FakeClock()
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid(79)) + raw(2, xid(13, "0000:00:07")) + raw(3, "usb 1-1: hi"))
    first = Node(tmp_path, clock)
    first.poll()
    assert stored(first) == [(13, 2), (79, 1)]
    assert first.store.load_cursor("kmsg") == f"kmsg:{BOOT}:3"
    assert first.active()[("79", "0000:00:06.0")] == 1
    first.stop()

    # more kernel records while the daemon was down
    with kmsg.open("a") as f:
        f.write(raw(4, xid(48)) + raw(5, "eth0: link up"))
    clock.advance(5)
    second = Node(tmp_path, clock)
    assert second.active()[("79", "0000:00:06.0")] == 1  # restored before any poll
    second.poll()
    assert stored(second) == [(13, 2), (48, 4), (79, 1)]
    assert second.store.load_cursor("kmsg") == f"kmsg:{BOOT}:5"
    second.poll()  # nothing new
    assert len(stored(second)) == 3
    second.stop()


def test_nvml_and_log_report_of_one_xid_store_one_event(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "kmsg").write_text(raw(1, xid(31)))
    node = Node(tmp_path, clock)
    node.poll()
    log_time = node.store.recent()[0]["time"]
    nvml = Event(
        "xid",
        "nvml",
        log_time + 1.6,
        31,
        "0000:00:06.0",
        attrs=(("gpu", "0"), ("uuid", "GPU-544a")),
    )
    node.state.publish(SourceSnapshot("nvml", (), True), [nvml])
    clock.advance(10)
    node.stage.tick()
    assert [r["code"] for r in node.store.recent()] == [31]
    merged = [
        s for s in node.state.snapshot().extra["xid"] if s.name == "gpuwatchd_xid_nvml_merged_total"
    ]
    assert merged[0].value == 1
    node.stop()


def test_nvml_only_xid_is_stored_after_the_hold(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "kmsg").write_text("")
    node = Node(tmp_path, clock)
    nvml = Event("xid", "nvml", clock.time(), 79, "00000000:00:06.0", attrs=(("gpu", "0"),))
    node.state.publish(SourceSnapshot("nvml", (), True), [nvml])
    assert node.store.recent() == []
    clock.advance(3)
    node.stage.tick()
    (row,) = node.store.recent()
    assert (row["code"], row["source"], row["severity"]) == (79, "nvml", "critical")
    assert row["pci_bus_id"] == "0000:00:06.0"
    node.stop()


def test_a_replays_nvml_xids_never_come_back_in_a_real_run(tmp_path: Path) -> None:
    """The README's replay demo shares ./.state with the node's real runs: an Xid the
    replayed capture reported (NVML's event API) is stored, but the next real run of the
    same boot must not restore it as active (a critical Xid on a GPU the node may not
    have, with reboot_node); a real run's own NVML Xid of this boot does come back."""
    clock = FakeClock()
    (tmp_path / "kmsg").write_text("")
    nvml = Event("xid", "nvml", clock.time(), 79, "00000000:00:06.0", attrs=(("gpu", "0"),))
    demo = Node(tmp_path, clock, replay=str(tmp_path / "capture.json"))
    demo.state.publish(SourceSnapshot("nvml", (), True), [nvml])
    clock.advance(3)
    demo.stage.tick()
    assert demo.active() == {("79", "0000:00:06.0"): 1.0}
    demo.stop()

    real = Node(tmp_path, clock)
    assert real.active() == {}  # nothing restored from the replay
    real.state.publish(SourceSnapshot("nvml", (), True), [nvml])
    clock.advance(3)
    real.stage.tick()
    real.stop()
    again = Node(tmp_path, clock)
    assert again.active() == {("79", "0000:00:06.0"): 1.0}  # its own, after a restart
    again.stop()


def test_clear_written_by_another_process_is_applied(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "kmsg").write_text(raw(1, xid(79)))
    node = Node(tmp_path, clock)
    node.poll()
    assert node.active()[("79", "0000:00:06.0")] == 1
    other = EventStore(node.store.path)  # e.g. `gpuwatchd clear` in another process
    other.add_clear("alice", pci_bus_id="0000:00:06.0", code=79, boot_id=BOOT)
    other.close()
    node.stage.tick()
    assert node.active()[("79", "0000:00:06.0")] == 0
    node.stop()


def test_operator_clear_and_reset_through_the_pipeline(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "kmsg").write_text(raw(1, xid(48)) + raw(2, xid(79, "0000:00:07")))
    node = Node(tmp_path, clock)
    node.poll()
    assert node.stage.gpu_reset("0000:00:06.0") == 1
    assert node.stage.clear("bob", "0000:00:07.0", 79, reason="reseated") == 1
    assert node.stage.active() == []
    assert [c.who for c in node.store.clears_since(0)] == ["gpu reset", "bob"]
    node.stop()


def test_metrics_cover_every_published_sample(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "kmsg").write_text(raw(1, xid(79)))
    node = Node(tmp_path, clock)
    node.poll()
    from gpuwatchd.sinks.store import METRICS as STORE_METRICS

    names = {m.name for m in (*METRICS, *STORE_METRICS)}  # the stage publishes the store's too
    assert {s.name for s in node.state.snapshot().extra["xid"]} <= names
    node.stop()


def test_reconfigure_keeps_state_and_applies_new_policy(tmp_path: Path) -> None:
    from gpuwatchd import config

    clock = FakeClock()
    # FakeClock's monotonic time is 1000 s: these records are seconds old, not minutes
    (tmp_path / "kmsg").write_text(raw(1, xid(13), usec=999_000_000))
    node = Node(tmp_path, clock)
    node.poll()
    assert [a.info.severity.name for a in node.stage.active()] == ["WARNING"]
    cfg = config.load_text("xid:\n  overrides:\n    13: {severity: critical}\n")
    node.stage.reconfigure(cfg)
    with (tmp_path / "kmsg").open("a") as f:
        f.write(raw(2, xid(13), usec=999_500_000))
    node.poll()
    assert [a.info.severity.name for a in node.stage.active()] == ["CRITICAL"]
    assert len(node.store.recent()) == 1  # same burst, one row
    node.stop()


def test_xid_log_entry_carries_journal_fields(tmp_path: Path, caplog) -> None:
    # Upper-case extras on the record are what systemd's JournalHandler sends as fields.
    (tmp_path / "kmsg").write_text(raw(1, xid(79, pid=4242)))
    node = Node(tmp_path, FakeClock())
    with caplog.at_level("WARNING", logger="gpuwatchd.health.xid.catalog"):
        node.poll()
    node.stop()
    rec = next(r for r in caplog.records if "Xid 79" in r.getMessage())
    assert rec.XID == "79"
    assert rec.PCI_BUS_ID == "0000:00:06.0"
    assert rec.XID_PID == "4242"
    assert rec.XID_SEVERITY == "critical"


def test_a_quiet_tick_leaves_the_snapshot_alone(tmp_path: Path) -> None:
    clock = FakeClock()
    (tmp_path / "kmsg").write_text(raw(1, xid(31)))
    node = Node(tmp_path, clock)
    node.poll()
    node.stage.tick()
    generation = node.state.snapshot().generation
    node.stage.tick()  # nothing new: no publish, the scrape cache stays valid
    assert node.state.snapshot().generation == generation
    nvml = Event("xid", "nvml", clock.time(), 79, "0000:00:07.0")
    node.state.publish(SourceSnapshot("nvml", (), True), [nvml])
    clock.advance(10)  # past the NVML hold: the stage passes it on and publishes
    generation = node.state.snapshot().generation
    node.stage.tick()
    assert node.state.snapshot().generation > generation
    node.stop()
