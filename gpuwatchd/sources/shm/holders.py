"""Which processes hold a /dev/shm segment: one pass over /proc maps and fds.

A segment is in use while any live process has it mapped
(/proc/<pid>/maps) or open (/proc/<pid>/fd). Processes are matched by the
file's (device, inode), not by path, so a container that sees the same
tmpfs under another path still counts. The /proc scan runs only when a
segment exists, once per poll, and reads each process's maps once; see
benchmarks/bench_shm.py for its cost.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.errors import SourceError

__all__ = ["HoldScan", "scan_holders"]


@dataclass
class HoldScan:
    """Result of one pass over /proc: which (dev, inode) pairs some process holds."""

    holders: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    processes: int = 0
    denied: int = 0  # processes we were not allowed to inspect
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return self.denied == 0


def scan_holders(
    procfs: str,
    wanted: Mapping[tuple[int, int], str],
    scan_fds: bool = True,
    max_pids: int = 8,
) -> HoldScan:
    """Find the processes that map or open any of `wanted` ((dev, ino) -> file name).

    Each process's maps file is read once and searched for the file names
    at C speed; only lines naming a candidate are parsed, and a match
    counts only if its device and inode agree. Fds are readlink()ed and
    stat()ed only when the link's last component is a candidate name.
    """
    started = time.monotonic()
    scan = HoldScan()
    if not wanted:
        return scan
    names = {name.encode() for name in wanted.values()}
    str_names = set(wanted.values())
    try:
        pids = [d for d in os.listdir(procfs) if d.isdigit()]
    except OSError as exc:
        raise SourceError("procfs", f"cannot list {procfs}: {exc.strerror}") from None
    for pid in pids:
        base = f"{procfs}/{pid}"
        try:
            content = _read_all(f"{base}/maps")
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            scan.denied += 1
            continue
        except OSError:
            continue  # ESRCH and friends: the process is going away
        scan.processes += 1
        held_here: set[tuple[int, int]] = set()
        if any(n in content for n in names):
            held_here.update(_maps_matches(content, names, wanted))
        if scan_fds:
            denied = _fd_matches(base, str_names, wanted, held_here)
            scan.denied += denied
        for key in held_here:
            pids_for = scan.holders.setdefault(key, [])
            if len(pids_for) < max_pids:
                pids_for.append(int(pid))
    scan.seconds = time.monotonic() - started
    return scan


def _read_all(path: str) -> bytes:
    # os.read in big chunks: the kernel builds maps text per read; no buffering layer
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 17):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _maps_matches(
    content: bytes, names: set[bytes], wanted: Mapping[tuple[int, int], str]
) -> Iterable[tuple[int, int]]:
    for line in content.split(b"\n"):
        if not any(n in line for n in names):
            continue
        # address perms offset dev inode pathname
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        major, _, minor = parts[3].partition(b":")
        try:
            key = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
        except ValueError:
            continue
        if key in wanted:
            yield key


def _fd_matches(
    base: str,
    names: set[str],
    wanted: Mapping[tuple[int, int], str],
    held: set[tuple[int, int]],
) -> int:
    fd_dir = f"{base}/fd"
    try:
        fds = os.listdir(fd_dir)
    except PermissionError:
        return 1
    except OSError:
        return 0
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.removesuffix(" (deleted)").rpartition("/")[2] not in names:
            continue
        try:
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in wanted:
            held.add(key)
    return 0
