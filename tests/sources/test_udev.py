"""udev hotplug: event -> source mapping, debouncing, and the fallback without udev.

Receiving real udev events needs udevd and root on a real host; here we
test what does not: the pure mapping over event properties as udev
reports them, the debounce, the fallback when /run/udev is absent, and
that a real pyudev netlink monitor starts when udev looks present.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from gpuwatchd.config import load_text
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.udev import UdevEvent, UdevSource, targets_for

GPU_REMOVE = UdevEvent(
    "remove",
    "pci",
    "/devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0/0000:19:00.0",
    {
        "DRIVER": "nvidia",
        "PCI_CLASS": "30200",
        "PCI_ID": "10DE:2330",
        "PCI_SLOT_NAME": "0000:19:00.0",
        "SUBSYSTEM": "pci",
    },
)


@pytest.mark.parametrize(
    ("event", "targets"),
    [
        (GPU_REMOVE, ("nvml", "aer")),
        (UdevEvent("unbind", "pci", "/devices/x", {"PCI_ID": "10de:2330"}), ("nvml", "aer")),
        (UdevEvent("change", "pci", "/devices/x", {"DRIVER": "nvidia"}), ("nvml", "aer")),
        (
            UdevEvent("add", "pci", "/devices/x", {"PCI_ID": "15B3:1021"}),
            ("infiniband", "aer"),
        ),
        (
            UdevEvent("add", "pci", "/devices/x", {"PCI_ID": "1234:5678", "PCI_CLASS": "20700"}),
            ("infiniband", "aer"),
        ),
        (UdevEvent("add", "pci", "/devices/x", {"PCI_ID": "8086:1572", "PCI_CLASS": "20000"}), ()),
        (
            UdevEvent("remove", "infiniband", "/devices/pci0000:16/.../infiniband/mlx5_0"),
            ("infiniband",),
        ),
        (
            UdevEvent("add", "infiniband_verbs", "/devices/x/infiniband_verbs/uverbs0"),
            ("infiniband",),
        ),
        (UdevEvent("change", "net", "/devices/pci0000:16/0000:1a:00.0/net/ib0"), ("infiniband",)),
        (UdevEvent("add", "net", "/devices/virtual/net/veth12ab"), ()),
        (UdevEvent("remove", "module", "/module/nvidia_uvm"), ("nvml",)),
        (UdevEvent("add", "module", "/module/mlx5_ib"), ("infiniband",)),
        (UdevEvent("add", "module", "/module/snd_hda_intel"), ()),
        (UdevEvent("frobnicate", "pci", "/devices/x", {"DRIVER": "nvidia"}), ()),
        (UdevEvent("add", "usb", "/devices/usb1"), ()),
    ],
)
def test_targets_for(event: UdevEvent, targets: tuple[str, ...]) -> None:
    assert targets_for(event) == targets


def test_events_nudge_their_source_once_per_debounce_window() -> None:
    nudged: list[str] = []
    src = UdevSource(nudged.append, run_udev="/nonexistent", debounce_seconds=30)
    assert src.handle(GPU_REMOVE) == ("nvml", "aer")
    src.handle(GPU_REMOVE)  # a burst: the second nudge waits for the window
    src.handle(UdevEvent("remove", "infiniband", "/devices/x/infiniband/mlx5_0"))
    assert nudged == ["aer", "nvml", "infiniband"]
    items = {(s.name, s.labels): s.value for s in src.poll(0)}
    assert items[("gpuwatchd_udev_events_total", (("action", "remove"), ("subsystem", "pci")))] == 2
    assert items[("gpuwatchd_udev_nudges_total", (("source", "nvml"),))] == 1


def test_without_debounce_every_event_nudges() -> None:
    nudged: list[str] = []
    src = UdevSource(nudged.append, run_udev="/nonexistent", debounce_seconds=0)
    src.handle(GPU_REMOVE)
    src.handle(GPU_REMOVE)
    assert nudged == ["aer", "nvml", "aer", "nvml"]


def test_without_udev_it_falls_back_to_polling_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "gpuwatchd.udev")
    src = UdevSource(lambda name: None, run_udev=str(tmp_path), fallback_interval=45)
    t0 = time.monotonic()
    first = list(src.poll(0))
    second = list(src.poll(1))
    assert time.monotonic() - t0 < 1.0  # no waiting when there is nothing to wait on
    assert [(s.name, s.value) for s in first] == [("gpuwatchd_udev_monitor_up", 0.0)]
    assert [(s.name, s.value) for s in second] == [("gpuwatchd_udev_monitor_up", 0.0)]
    assert src.interval == 45
    assert caplog.text.count("udev is not running here") == 1
    assert src.status()["listening"] is False


def netlink_monitor_possible() -> bool:
    try:
        import pyudev

        pyudev.Monitor.from_netlink(pyudev.Context(), source="udev")
        return True
    except Exception:
        return False


@pytest.mark.skipif(not netlink_monitor_possible(), reason="pyudev/libudev/netlink unavailable")
def test_with_udev_present_it_listens_and_polls_return_after_the_wait(tmp_path: Path) -> None:
    # udevd's control socket is how libudev decides udev runs; a file stands in for it here.
    (tmp_path / "control").touch()
    src = UdevSource(lambda name: None, run_udev=str(tmp_path), wait_seconds=0.2)
    t0 = time.monotonic()
    items = list(src.poll(0))
    elapsed = time.monotonic() - t0
    assert [(s.name, s.value) for s in items][0] == ("gpuwatchd_udev_monitor_up", 1.0)
    assert 0.15 <= elapsed < 2.0
    assert src.interval == 0.0  # the wait happens inside poll()
    src.close()


def test_from_config() -> None:
    cfg = load_text("sources: {udev: {fallback_interval: 5, debounce_seconds: 0}}")
    nudged: list[str] = []
    src = UdevSource.from_config(cfg, SourceContext(nudge=nudged.append))
    src.handle(GPU_REMOVE)
    assert nudged == ["aer", "nvml"]
