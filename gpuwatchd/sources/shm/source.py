"""/dev/shm capacity and NCCL shared-memory segments: in use, stale, optionally removed.

Segment names. Current NCCL creates its host shared-memory segments with
mkstemp("/dev/shm/nccl-XXXXXX") (src/misc/shmutils.cc); older releases
used shm_open() names such as "nccl-shm-recv-<hash>-<channel>-<rank>-..."
(src/transport/shm.cc). Both match the default glob `nccl-*`. NCCL
unlinks a segment as soon as the last peer has attached to it, so in a
healthy job these files live for seconds; one that is still there long
after, with no process holding it, was left by a rank that died (or was
killed) while the communicator was being set up. It keeps its memory
until someone deletes it, and enough of them fill /dev/shm, after which
NCCL fails with a system error ("Error while creating shared memory
segment").

Holders are found by one pass over /proc (holders.py).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwatchd.errors import ConfigError, SourceError
from gpuwatchd.model import Event, MetricSpec, Sample, Severity
from gpuwatchd.sources.shm.holders import HoldScan, scan_holders

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = ["METRICS", "Segment", "ShmSource"]

log = logging.getLogger("gpuwatchd.shm")

STATES = ("in_use", "stale", "unclaimed", "unverified")

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("gpuwatchd_shm_size_bytes", "gauge", "Size of the /dev/shm filesystem."),
    MetricSpec(
        "gpuwatchd_shm_available_bytes",
        "gauge",
        "Bytes of /dev/shm available to unprivileged users.",
    ),
    MetricSpec("gpuwatchd_shm_files", "gauge", "Inodes /dev/shm can hold (statvfs f_files)."),
    MetricSpec("gpuwatchd_shm_files_free", "gauge", "Free inodes in /dev/shm."),
    MetricSpec(
        "gpuwatchd_shm_segments",
        "gauge",
        "NCCL shared-memory segments in /dev/shm by state: in_use (a live process maps or "
        "opens it), stale (nobody holds it and it is older than the grace period), "
        "unclaimed (nobody holds it yet, within the grace period), unverified (no "
        "inspected process holds it, but some processes could not be inspected).",
        ("state",),
    ),
    MetricSpec(
        "gpuwatchd_shm_segment_bytes",
        "gauge",
        "Memory allocated to NCCL segments in /dev/shm, by state.",
        ("state",),
    ),
    MetricSpec(
        "gpuwatchd_shm_scan_processes",
        "gauge",
        "Processes whose maps and fds the last holder scan examined (0: no segment, no scan).",
    ),
    MetricSpec(
        "gpuwatchd_shm_scan_incomplete",
        "gauge",
        "1 if some processes could not be inspected (permissions), so a segment counted "
        "stale may be held; clean-up is skipped while this is 1.",
    ),
    MetricSpec(
        "gpuwatchd_shm_stale_removed_total",
        "counter",
        "Stale NCCL segments deleted by shm.cleanup_stale.",
    ),
    MetricSpec(
        "gpuwatchd_shm_stale_removed_bytes_total",
        "counter",
        "Bytes freed by deleting stale NCCL segments.",
    ),
    MetricSpec(
        "gpuwatchd_shm_errors_total",
        "counter",
        "Problems reading /dev/shm or /proc, or removing a segment, by reason.",
        ("reason",),
    ),
)


@dataclass(frozen=True)
class Segment:
    """One file in /dev/shm that matches a segment pattern."""

    name: str
    dev: int
    ino: int
    bytes: int  # allocated (st_blocks * 512): what the segment costs in memory
    size: int  # st_size
    mtime: float  # NCCL fallocate()s at creation and writes through the map: ~creation time

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


class ShmSource:
    """statvfs of /dev/shm plus the NCCL segments in it and who holds them."""

    name = "shm"

    def __init__(
        self,
        path: str,
        procfs: str,
        patterns: Sequence[str],
        grace_seconds: float,
        cleanup: bool = False,
        scan_fds: bool = True,
        interval: float = 30.0,
        status_segments: int = 50,
    ) -> None:
        for p in patterns:
            if "/" in p or not p:
                raise ConfigError("", "sources.shm.patterns", f"not a file name glob: {p!r}")
        self.interval = interval
        self._path = path
        self._procfs = procfs
        self._patterns = tuple(patterns)
        self._grace = grace_seconds
        self._cleanup = cleanup
        self._scan_fds = scan_fds
        self._status_segments = status_segments
        self._removed = 0
        self._removed_bytes = 0
        self._errors: dict[str, int] = {}
        self._denied = False
        self._status: dict[str, object] = {"path": path}

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> ShmSource:
        """Build from sources.shm and paths.*."""
        c = cfg.sources.shm
        return cls(
            cfg.paths.dev_shm,
            cfg.paths.procfs,
            c.patterns,
            c.grace_seconds,
            cleanup=c.cleanup_stale,
            scan_fds=c.scan_fds,
            interval=c.interval,
            status_segments=c.status_segments,
        )

    def poll(self, now: float) -> Sequence[Sample | Event]:
        out: list[Sample | Event] = []
        try:
            dir_fd = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            msg = f"cannot open {self._path}: {exc.strerror}"
            raise SourceError("shm_unreadable", msg) from None
        try:
            out.extend(self._capacity(dir_fd))
            segments = self._segments(dir_fd)
            wanted = {s.key: s.name for s in segments}
            scan = scan_holders(self._procfs, wanted, self._scan_fds)
            if scan.denied:
                self._count("procfs_denied")
            self._say_denied(scan)
            states = self._classify(segments, scan, now)
            if self._cleanup and scan.complete:
                out.extend(self._remove_stale(dir_fd, segments, states, now))
        finally:
            os.close(dir_fd)
        out.extend(self._segment_samples(segments, states))
        out.append(Sample.of("gpuwatchd_shm_scan_processes", scan.processes))
        out.append(Sample.of("gpuwatchd_shm_scan_incomplete", 0 if scan.complete else 1))
        out.append(Sample.of("gpuwatchd_shm_stale_removed_total", self._removed))
        out.append(Sample.of("gpuwatchd_shm_stale_removed_bytes_total", self._removed_bytes))
        out.extend(
            Sample.of("gpuwatchd_shm_errors_total", n, reason=r) for r, n in self._errors.items()
        )
        self._status = self._make_status(segments, states, scan, now)
        return out

    def status(self) -> Mapping[str, object]:
        return self._status

    def close(self) -> None:
        pass

    # --- parts of a poll ---------------------------------------------------------

    def _capacity(self, dir_fd: int) -> list[Sample]:
        try:
            st = os.statvfs(dir_fd)
        except OSError as exc:
            raise SourceError("shm_statvfs", f"statvfs {self._path}: {exc.strerror}") from None
        return [
            Sample.of("gpuwatchd_shm_size_bytes", st.f_blocks * st.f_frsize),
            Sample.of("gpuwatchd_shm_available_bytes", st.f_bavail * st.f_frsize),
            Sample.of("gpuwatchd_shm_files", st.f_files),
            Sample.of("gpuwatchd_shm_files_free", st.f_ffree),
        ]

    def _segments(self, dir_fd: int) -> list[Segment]:
        found: list[Segment] = []
        try:
            entries = list(os.scandir(dir_fd))
        except OSError as exc:
            msg = f"cannot list {self._path}: {exc.strerror}"
            raise SourceError("shm_unreadable", msg) from None
        for entry in entries:
            if not any(fnmatch.fnmatchcase(entry.name, p) for p in self._patterns):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if not stat.S_ISREG(st.st_mode):
                continue  # symlinks and directories are never segments
            found.append(
                Segment(
                    entry.name,
                    st.st_dev,
                    st.st_ino,
                    st.st_blocks * 512,
                    st.st_size,
                    st.st_mtime,
                )
            )
        return found

    def _classify(self, segments: Sequence[Segment], scan: HoldScan, now: float) -> dict[str, str]:
        states: dict[str, str] = {}
        for seg in segments:
            if seg.key in scan.holders:
                states[seg.name] = "in_use"
            elif now - seg.mtime <= self._grace:
                states[seg.name] = "unclaimed"
            elif scan.complete:
                states[seg.name] = "stale"
            else:
                # A process we could not inspect may hold it: never call it stale.
                states[seg.name] = "unverified"
        return states

    def _say_denied(self, scan: HoldScan) -> None:
        denied = scan.denied > 0
        if denied and not self._denied:
            log.warning(
                "%d processes could not be inspected (reading another user's /proc/PID/maps "
                "needs CAP_SYS_PTRACE): unheld segments are reported unverified, not stale, "
                "and none is removed",
                scan.denied,
            )
        elif self._denied and not denied and scan.processes:
            log.info("every process can be inspected again")
        if scan.processes or denied:
            self._denied = denied

    def _remove_stale(
        self,
        dir_fd: int,
        segments: Sequence[Segment],
        states: Mapping[str, str],
        now: float,
    ) -> list[Event]:
        events: list[Event] = []
        for seg in segments:
            if states.get(seg.name) != "stale":
                continue
            # Re-check right before unlinking: a process may have attached since the scan.
            again = scan_holders(self._procfs, {seg.key: seg.name}, self._scan_fds)
            if not again.complete or seg.key in again.holders:
                log.info("keeping %s: held or not verifiable on re-check", seg.name)
                continue
            if self._unlink(dir_fd, seg):
                self._removed += 1
                self._removed_bytes += seg.bytes
                log.warning(
                    "removed stale NCCL segment %s/%s (%d bytes, unused for %.0f s)",
                    self._path,
                    seg.name,
                    seg.bytes,
                    now - seg.mtime,
                )
                events.append(
                    Event(
                        kind="shm_segment_removed",
                        source=self.name,
                        time=now,
                        message=f"removed stale {self._path}/{seg.name} ({seg.bytes} bytes)",
                        severity=Severity.INFO,
                        attrs=(("bytes", str(seg.bytes)), ("name", seg.name)),
                    )
                )
        return events

    def _unlink(self, dir_fd: int, seg: Segment) -> bool:
        # O_NOFOLLOW: if the name was swapped for a symlink since the scan, open fails
        # and nothing outside the directory is touched.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(seg.name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return False  # someone else removed it
        except OSError as exc:
            self._count("remove_failed")
            log.warning("cannot open %s for removal: %s", seg.name, exc.strerror)
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != seg.key:
                log.info("not removing %s: it changed since the scan", seg.name)
                return False
            os.unlink(seg.name, dir_fd=dir_fd)
            return True
        except OSError as exc:
            self._count("remove_failed")
            log.warning("cannot remove %s: %s", seg.name, exc.strerror)
            return False
        finally:
            os.close(fd)

    def _segment_samples(
        self, segments: Sequence[Segment], states: Mapping[str, str]
    ) -> list[Sample]:
        count = dict.fromkeys(STATES, 0)
        size = dict.fromkeys(STATES, 0)
        for seg in segments:
            state = states[seg.name]
            count[state] += 1
            size[state] += seg.bytes
        return [Sample.of("gpuwatchd_shm_segments", count[s], state=s) for s in STATES] + [
            Sample.of("gpuwatchd_shm_segment_bytes", size[s], state=s) for s in STATES
        ]

    def _make_status(
        self,
        segments: Sequence[Segment],
        states: Mapping[str, str],
        scan: HoldScan,
        now: float,
    ) -> dict[str, object]:
        listed = sorted(segments, key=lambda s: (states[s.name] != "stale", -s.bytes))
        return {
            "path": self._path,
            "patterns": list(self._patterns),
            "grace_seconds": self._grace,
            "cleanup_stale": self._cleanup,
            "segments": [
                {
                    "name": s.name,
                    "state": states[s.name],
                    "bytes": s.bytes,
                    "age_seconds": round(now - s.mtime, 1),
                    "holders": scan.holders.get(s.key, []),
                }
                for s in listed[: self._status_segments]
            ],
            "segments_total": len(segments),
            "scan": {
                "processes": scan.processes,
                "denied": scan.denied,
                "seconds": round(scan.seconds, 4),
            },
            "removed_total": self._removed,
        }

    def _count(self, reason: str) -> None:
        self._errors[reason] = self._errors.get(reason, 0) + 1
