"""The kmsg source on real captured lines: a kernel log file, restarts, reader failures."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config, KmsgConfig, SourcesConfig
from gpuwatchd.model import Event, Gpu, GpuInventory, Sample
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.kmsg.source import KmsgSource
from tests.sources.kmsg_files import FIX, kmsg_config, raw, xid_line


def source(cfg: Config, **ctx: object) -> KmsgSource:
    clock = FakeClock()
    return KmsgSource(
        cfg,
        SourceContext(clock=clock, **ctx),
        wait=0.05,  # type: ignore[arg-type]
        sleep=lambda s: None,
    )


def events(items: object) -> list[Event]:
    return [i for i in items if isinstance(i, Event)]  # type: ignore[attr-defined]


def sample(items: object, name: str, **labels: str) -> float:
    for i in items:  # type: ignore[attr-defined]
        if (
            isinstance(i, Sample)
            and i.name == name
            and all(i.label(k) == v for k, v in labels.items())
        ):
            return i.value
    raise AssertionError(f"no sample {name}")


def test_source_reads_the_real_h200_record(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    lines = [
        ln
        for ln in (FIX / "h200-xid31-kmsg.txt").read_text().splitlines()
        if re.match(r"\d+,\d+,", ln)
    ]
    kmsg.write_text("\n".join(lines) + "\n")
    src = source(kmsg_config(tmp_path, kmsg))
    out = src.poll(src.clock.time() - src.clock.monotonic() + 50.0)  # 1.5 s after the fault
    evs = events(out)
    assert [(e.kind, e.code, e.pci_bus_id) for e in evs] == [("xid", 31, "0000:00:06.0")]
    ev = evs[0]
    assert ev.attr("pid") == "650" and ev.attr("process") == "python3"
    assert ev.attr("cursor") == "kmsg:6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001:373"
    assert ev.attr("sequence") == "373"
    assert ev.attr("attribution") == "process gone"  # no /proc/650 in our fake root
    assert "FAULT_PDE" in ev.attr("raw")
    # the user-space record (facility 1) is counted, not reported
    assert sample(out, "gpuwatchd_kmsg_spoofed_xid_lines_total") == 1
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 1
    assert src.status()["cursor"] == "kmsg:6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001:374"


def test_accept_userspace_switch(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(5, xid_line("0000:00:06", 79), facility=1))
    out = source(kmsg_config(tmp_path, kmsg, accept_userspace=True)).poll(0.0)
    assert [e.code for e in events(out)] == [79]
    assert events(out)[0].attr("origin") == "user"


def test_event_time_comes_from_the_kernel_timestamp(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid_line("0000:00:06", 31), usec=48_494_739))
    src = source(kmsg_config(tmp_path, kmsg))
    clock = src.clock
    ev = events(src.poll(0.0))[0]
    boot_wall = clock.time() - clock.monotonic()
    assert ev.time == pytest.approx(boot_wall + 48.494739)
    assert ev.attr("kernel_time") == "48.494739"


def test_gpu_index_and_identity_lines_name_the_gpu(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        raw(1, "NVRM: GPU at PCI:0000:00:06: GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6")
        + raw(2, xid_line("0000:00:06", 31))
        + raw(3, xid_line("0000:00:07", 31))
    )
    # NVML's inventory; the driver's line spells the bus id its own way
    index = GpuInventory((Gpu(index=1, uuid="GPU-0000-from-nvml", pci_bus_id="0000:00:07.0"),))
    out = source(kmsg_config(tmp_path, kmsg), gpus=lambda: index).poll(0.0)
    got = [(e.pci_bus_id, e.attr("gpu"), e.attr("uuid")) for e in events(out)]
    assert got == [
        ("0000:00:06.0", "", "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"),
        ("0000:00:07.0", "1", "GPU-0000-from-nvml"),
    ]


def test_unparsed_lines_are_counted_and_logged_once_per_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        raw(1, "NVRM: Xid (PCI:...): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 11 (...)")
        + raw(2, "NVRM: Xid (PCI:...): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 12 (...)")
        + raw(3, "NVRM: Xid (PCI:...): 137, some other shape entirely")
    )
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.sources.kmsg.source"):
        out = source(kmsg_config(tmp_path, kmsg)).poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_unparsed_xid_lines_total") == 3
    assert not events(out)
    logged = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert len(logged) == 2


def test_restart_neither_repeats_nor_misses(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join(raw(i, xid_line("0000:00:06", 13, rest=f"n{i}")) for i in range(1, 4)))
    cfg = kmsg_config(tmp_path, kmsg)
    first = source(cfg)
    seen = [e.attr("sequence") for e in events(first.poll(0.0))]
    cursor = str(first.status()["cursor"])
    first.close()
    # the kernel logged more while we were down; the ring buffer still holds all of it
    with kmsg.open("a") as f:
        f.write("".join(raw(i, xid_line("0000:00:06", 13, rest=f"n{i}")) for i in range(4, 6)))
    second = source(cfg, load_cursor=lambda name: cursor if name == "kmsg" else None)
    seen += [e.attr("sequence") for e in events(second.poll(0.0))]
    assert seen == ["1", "2", "3", "4", "5"]


def test_restart_in_a_new_boot_reads_everything(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join(raw(i, xid_line("0000:00:06", 13)) for i in range(1, 4)))
    cfg = kmsg_config(tmp_path, kmsg)
    old = "kmsg:another-boot:2"
    out = source(cfg, load_cursor=lambda name: old).poll(0.0)
    assert [e.attr("sequence") for e in events(out)] == ["1", "2", "3"]


def test_records_lost_while_down_are_counted(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(10, "usb 1-1: new device") + raw(11, xid_line("0000:00:06", 13)))
    cfg = kmsg_config(tmp_path, kmsg)
    boot = Path(cfg.paths.boot_id).read_text().strip()
    out = source(cfg, load_cursor=lambda name: f"kmsg:{boot}:4").poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_records_lost_total", backend="kmsg") == 5  # 5..9


def test_reader_failure_backs_off_and_reports_reader_down(tmp_path: Path) -> None:
    cfg = kmsg_config(tmp_path, tmp_path / "no-such-kmsg")
    slept: list[float] = []
    clock = FakeClock()
    src = KmsgSource(cfg, SourceContext(clock=clock), wait=0.5, sleep=slept.append)
    opens = 0
    real_opener = src._opener

    def counting(cursor: str | None) -> object:
        nonlocal opens
        opens += 1
        return real_opener(cursor)

    src._opener = counting  # type: ignore[assignment]
    out = src.poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 0
    assert "does not exist" in str(src.status()["error"])
    for _ in range(10):  # ten quick polls within the first second: no reopen storm
        src.poll(0.0)
        clock.advance(0.05)
    assert opens == 1
    assert all(s <= 0.5 for s in slept) and slept, "polls must wait, never spin"
    clock.advance(1.0)
    src.poll(0.0)
    assert opens == 2  # retried after >= 1 s
    clock.advance(1.0)
    src.poll(0.0)
    assert opens == 2  # next wait is 2 s
    # the device appears: the reader comes back and says so
    (tmp_path / "no-such-kmsg").write_text(raw(1, xid_line("0000:00:06", 79)))
    clock.advance(2.0)
    out = src.poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 1
    assert sample(out, "gpuwatchd_kmsg_reader_restarts_total", backend="kmsg") == 1
    assert [e.code for e in events(out)] == [79]


def test_attribution_from_a_kubernetes_pod(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid_line("0000:00:06", 31, pid=4242, name="python3")))
    cfg = kmsg_config(tmp_path, kmsg)
    proc = Path(cfg.paths.procfs) / "4242"
    proc.mkdir()
    (proc / "comm").write_text("python3\n")
    (proc / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        "1f0c6e2a_3b4d_4c5e_9f60_7a8b9c0d1e2f.slice/cri-containerd-" + "ab" * 32 + ".scope\n"
    )
    src = source(cfg)
    # the record is fresh: make the fake clock's "now" match its time
    ev = events(src.poll(src.clock.time() - src.clock.monotonic() + 0.001))[0]
    assert ev.attr("attribution") == "kubernetes"
    assert ev.attr("pod_uid") == "1f0c6e2a-3b4d-4c5e-9f60-7a8b9c0d1e2f"
    assert ev.attr("container_id") == "ab" * 32


def test_old_records_are_not_attributed(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(raw(1, xid_line("0000:00:06", 31, pid=1)))
    src = source(kmsg_config(tmp_path, kmsg))
    ev = events(src.poll(src.clock.time() + 3600))[0]
    assert ev.attr("pid") == "1"
    assert "too old" in ev.attr("attribution")


def test_reports_from_a_file_backend(tmp_path: Path) -> None:
    log = tmp_path / "dmesg.log"
    log.write_text((FIX / "dmesg-T-h100-xid119.txt").read_text())
    cfg = kmsg_config(tmp_path, tmp_path / "unused")
    cfg = replace(cfg, sources=SourcesConfig(kmsg=KmsgConfig(backend="file", file=str(log))))
    src = source(cfg)
    evs = events(src.poll(0.0))
    assert len(evs) == 5 and {e.code for e in evs} == {119}
    assert evs[0].attr("uuid") == "GPU-509665ad-b600-ac93-3616-d754b23d636d"
    # dmesg -T stamps are local wall time
    assert evs[0].time == pytest.approx(
        __import__("time").mktime((2025, 2, 23, 16, 24, 18, 0, 0, -1))
    )
    assert "sequence" not in dict(evs[0].attrs)


class _IdleReader:
    """A kernel log reader with nothing lost, no cursor and nothing to close."""

    name = "kmsg"

    def interrupt(self) -> None:
        pass

    def cursor(self) -> str:
        return ""

    def take_lost(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_a_reader_bug_backs_off_instead_of_spinning(tmp_path: Path) -> None:
    class Broken(_IdleReader):
        def read(self, timeout: float) -> list[object]:
            raise ValueError("bug in a reader")

    cfg = kmsg_config(tmp_path, tmp_path / "kmsg")
    clock = FakeClock()
    opened: list[str | None] = []

    def opener(cursor: str | None) -> Broken:
        opened.append(cursor)
        return Broken()

    src = KmsgSource(cfg, SourceContext(clock=clock), opener=opener, sleep=lambda s: None)
    out = src.poll(0.0)
    assert sample(out, "gpuwatchd_kmsg_reader_up", backend="kmsg") == 0
    assert "bug in a reader" in str(src.status()["error"])
    src.poll(0.0)
    src.poll(0.0)
    assert len(opened) == 1  # no reopen before the backoff


def test_the_first_read_never_waits_so_a_restart_caught_up_starts_at_once(tmp_path: Path) -> None:
    """A restart whose cursor is at the log's end found nothing to read, and its first read
    waited the blocking reader's 10 s: the daemon's start-up (which waits for every first
    poll) took 10 s longer on a used state dir. The first read says "caught up" at once."""

    class Caught(_IdleReader):  # a /dev/kmsg reader at the end of the log
        def __init__(self) -> None:
            self.waits: list[float] = []

        def read(self, timeout: float) -> list[object]:
            self.waits.append(timeout)  # each read waits its timeout
            return []

    reader = Caught()
    cfg = kmsg_config(tmp_path, tmp_path / "kmsg")
    src = KmsgSource(
        cfg, SourceContext(clock=FakeClock()), opener=lambda cursor: reader, sleep=lambda s: None
    )
    src.poll(0.0)
    src.poll(0.0)
    assert reader.waits == [0.0, 10.0]  # then the blocking reader waits as before
