"""ShmSource against a real directory and real processes that map or open its files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.config import load_text
from gpuwatchd.errors import ConfigError
from gpuwatchd.model import Event, Sample
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.shm.holders import scan_holders
from gpuwatchd.sources.shm.source import ShmSource

HOLDER = r"""
import mmap, os, sys
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if how == "map":
    m = mmap.mmap(fd, 0)
    os.close(fd)  # only the mapping keeps the file
print("ready", flush=True)
sys.stdin.readline()
"""


class Holder:
    """A real process holding `path` by a shared mapping (`map`) or an open fd (`fd`)."""

    def __init__(self, path: Path, how: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), how],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit(self) -> None:
        self.proc.communicate("bye\n", timeout=10)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for h in started:
        if h.proc.poll() is None:
            h.proc.kill()
        h.proc.communicate()


def segment(directory: Path, name: str, size: int = 65536, age: float = 0.0) -> Path:
    path = directory / name
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)  # as NCCL does
    if age:
        t = time.time() - age
        os.utime(path, (t, t))
    return path


def proc_view(root: Path) -> str:
    """A procfs root with every process of the real /proc that this user may inspect.

    Clean-up refuses to run while any process cannot be inspected; some
    sandboxes hide a process even from root. The view keeps the test about
    the clean-up logic, over real processes.
    """
    view = root / "procview"
    view.mkdir()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                f.read(1)
            os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        (view / pid).symlink_to(f"/proc/{pid}")
    return str(view)


def values(items: list[Sample | Event], name: str) -> dict[str, float]:
    return {
        s.label("state") or s.label("reason"): s.value
        for s in items
        if isinstance(s, Sample) and s.name == name
    }


def one(items: list[Sample | Event], name: str) -> float:
    (value,) = [s.value for s in items if isinstance(s, Sample) and s.name == name]
    return value


def test_capacity_is_statvfs_of_the_directory(tmp_path: Path) -> None:
    items = list(ShmSource(str(tmp_path), "/proc", ["nccl-*"], 60).poll(time.time()))
    st = os.statvfs(tmp_path)
    assert one(items, "gpuwatchd_shm_size_bytes") == st.f_blocks * st.f_frsize
    assert one(items, "gpuwatchd_shm_files") == st.f_files
    assert one(items, "gpuwatchd_shm_available_bytes") > 0
    assert one(items, "gpuwatchd_shm_scan_processes") == 0  # no segment, no /proc scan


def test_mapped_segment_is_in_use_until_its_process_exits(
    tmp_path: Path, holders: list[Holder]
) -> None:
    seg = segment(tmp_path, "nccl-Ab12Cd", age=3600)
    segment(tmp_path, "unrelated-file", age=3600)
    holder = Holder(seg, "map")
    holders.append(holder)
    src = ShmSource(str(tmp_path), proc_view(tmp_path), ["nccl-*"], grace_seconds=60)

    items = list(src.poll(time.time()))
    assert values(items, "gpuwatchd_shm_segments") == {
        "in_use": 1,
        "stale": 0,
        "unclaimed": 0,
        "unverified": 0,
    }
    assert values(items, "gpuwatchd_shm_segment_bytes")["in_use"] >= 65536
    listed = src.status()["segments"]
    assert isinstance(listed, list)
    assert listed[0]["holders"] == [holder.pid]
    assert one(items, "gpuwatchd_shm_scan_processes") > 1

    holder.exit()
    items = list(src.poll(time.time()))
    assert values(items, "gpuwatchd_shm_segments")["stale"] == 1
    assert values(items, "gpuwatchd_shm_segments")["in_use"] == 0
    assert seg.exists()  # clean-up is off by default


def test_young_unheld_segment_is_unclaimed_not_stale(tmp_path: Path) -> None:
    segment(tmp_path, "nccl-new123")
    items = list(ShmSource(str(tmp_path), "/proc", ["nccl-*"], 300).poll(time.time()))
    assert values(items, "gpuwatchd_shm_segments") == {
        "in_use": 0,
        "stale": 0,
        "unclaimed": 1,
        "unverified": 0,
    }


def test_open_fd_holds_a_segment_only_when_fds_are_scanned(
    tmp_path: Path, holders: list[Holder]
) -> None:
    seg = segment(tmp_path, "nccl-fdonly", age=3600)
    holders.append(Holder(seg, "fd"))
    view = proc_view(tmp_path)
    with_fds = ShmSource(str(tmp_path), view, ["nccl-*"], 60, scan_fds=True)
    maps_only = ShmSource(str(tmp_path), view, ["nccl-*"], 60, scan_fds=False)
    assert values(list(with_fds.poll(time.time())), "gpuwatchd_shm_segments")["in_use"] == 1
    assert values(list(maps_only.poll(time.time())), "gpuwatchd_shm_segments")["stale"] == 1


def test_holders_are_matched_by_inode_not_by_name(tmp_path: Path, holders: list[Holder]) -> None:
    # The process maps a file called nccl-same in another directory: same name, other inode.
    other = tmp_path / "elsewhere"
    other.mkdir()
    holders.append(Holder(segment(other, "nccl-same"), "map"))
    mine = tmp_path / "shm"
    mine.mkdir()
    segment(mine, "nccl-same", age=3600)
    items = list(ShmSource(str(mine), proc_view(tmp_path), ["nccl-*"], 60).poll(time.time()))
    assert values(items, "gpuwatchd_shm_segments")["stale"] == 1


def test_cleanup_removes_stale_and_keeps_held_segments(
    tmp_path: Path, holders: list[Holder], caplog: pytest.LogCaptureFixture
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    held = segment(shm, "nccl-held01", age=3600)
    stale = segment(shm, "nccl-stale1", size=1 << 20, age=3600)
    young = segment(shm, "nccl-young1")
    holders.append(Holder(held, "map"))
    src = ShmSource(str(shm), proc_view(tmp_path), ["nccl-*"], 60, cleanup=True)

    items = list(src.poll(time.time()))
    assert held.exists() and young.exists()
    assert not stale.exists()
    assert one(items, "gpuwatchd_shm_stale_removed_total") == 1
    assert one(items, "gpuwatchd_shm_stale_removed_bytes_total") >= 1 << 20
    assert one(items, "gpuwatchd_shm_scan_incomplete") == 0
    events = [e for e in items if isinstance(e, Event)]
    assert [e.attr("name") for e in events] == ["nccl-stale1"]
    assert "removed stale NCCL segment" in caplog.text


def test_cleanup_rechecks_holders_right_before_unlinking(
    tmp_path: Path, holders: list[Holder]
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    path = segment(shm, "nccl-late01", age=3600)
    src = ShmSource(str(shm), proc_view(tmp_path), ["nccl-*"], 60, cleanup=True)
    dir_fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        segments = src._segments(dir_fd)
        # The scan found nobody; now a process attaches before the clean-up runs.
        holders.append(Holder(path, "map"))
        src._procfs = proc_view_again(tmp_path, holders[-1].pid)
        events = src._remove_stale(dir_fd, segments, {"nccl-late01": "stale"}, time.time())
    finally:
        os.close(dir_fd)
    assert events == []
    assert path.exists()


def proc_view_again(tmp_path: Path, pid: int) -> str:
    view = tmp_path / "procview"
    (view / str(pid)).symlink_to(f"/proc/{pid}")
    return str(view)


def test_symlinks_are_never_segments_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = segment(outside, "precious", age=3600)
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "nccl-evil01").symlink_to(target)
    src = ShmSource(str(shm), proc_view(tmp_path), ["nccl-*"], 0, cleanup=True)
    items = list(src.poll(time.time()))
    assert sum(values(items, "gpuwatchd_shm_segments").values()) == 0
    assert target.exists() and (shm / "nccl-evil01").is_symlink()


def test_a_segment_swapped_for_a_symlink_after_the_scan_is_not_removed(tmp_path: Path) -> None:
    # The very inode the scan saw now lives outside, and a symlink to it took its name.
    shm = tmp_path / "shm"
    shm.mkdir()
    segment(shm, "nccl-swap01", age=3600)
    outside = tmp_path / "outside"
    src = ShmSource(str(shm), "/proc", ["nccl-*"], 60, cleanup=True)
    dir_fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (seg,) = src._segments(dir_fd)
        os.rename(shm / "nccl-swap01", outside)
        (shm / "nccl-swap01").symlink_to(outside)
        assert src._unlink(dir_fd, seg) is False
    finally:
        os.close(dir_fd)
    assert outside.exists() and (shm / "nccl-swap01").is_symlink()


def test_a_file_replaced_by_another_after_the_scan_is_not_removed(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    segment(shm, "nccl-repl01", age=3600)
    src = ShmSource(str(shm), "/proc", ["nccl-*"], 60, cleanup=True)
    dir_fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (seg,) = src._segments(dir_fd)
        keep = tmp_path / "keep"
        os.link(shm / "nccl-repl01", keep)  # keeps the old inode alive and distinct
        os.unlink(shm / "nccl-repl01")
        segment(shm, "nccl-repl01")  # a new job reused the name: new inode
        assert src._unlink(dir_fd, seg) is False
    finally:
        os.close(dir_fd)
    assert (shm / "nccl-repl01").exists()


def uninspectable_pid() -> str | None:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps", "rb") as f:
                    f.read(1)
            except PermissionError:
                return pid
            except OSError:
                continue
    return None


@pytest.mark.skipif(uninspectable_pid() is None, reason="every process is inspectable here")
def test_unverified_not_stale_and_no_cleanup_when_a_process_cannot_be_inspected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = segment(tmp_path, "nccl-stale9", age=3600)
    src = ShmSource(str(tmp_path), "/proc", ["nccl-*"], 60, cleanup=True)
    items = list(src.poll(time.time()))
    src.poll(time.time())
    assert old.exists()
    assert values(items, "gpuwatchd_shm_segments")["unverified"] == 1
    assert values(items, "gpuwatchd_shm_segments")["stale"] == 0
    assert one(items, "gpuwatchd_shm_scan_incomplete") == 1
    assert values(items, "gpuwatchd_shm_errors_total")["procfs_denied"] >= 1
    assert caplog.text.count("could not be inspected") == 1  # said once, not every poll


def test_scan_holders_without_candidates_reads_nothing() -> None:
    scan = scan_holders("/nonexistent-procfs", {})
    assert scan.processes == 0 and scan.complete


def test_patterns_must_be_file_name_globs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sources.shm.patterns"):
        ShmSource(str(tmp_path), "/proc", ["../etc/*"], 60)


def test_from_config_uses_injected_paths(tmp_path: Path) -> None:
    segment(tmp_path, "torch_1234_0", age=3600)
    cfg = load_text(
        f"paths: {{dev_shm: {tmp_path}, procfs: {proc_view(tmp_path)}}}\n"
        "sources: {shm: {patterns: ['torch_*'], grace_seconds: 10, cleanup_stale: false}}\n"
    )
    src = ShmSource.from_config(cfg, SourceContext())
    items = list(src.poll(time.time()))
    assert values(items, "gpuwatchd_shm_segments")["stale"] == 1
    assert src.status()["path"] == str(tmp_path)
