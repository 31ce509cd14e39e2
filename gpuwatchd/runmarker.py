"""What one run leaves in the state dir for the next: a run marker and a fault log.

- `<state dir>/gpuwatchd.run` is written at start (pid, boot id, start time)
  and removed by a clean stop. Found at start, it says the previous run
  ended some other way: killed (SIGKILL, OOM), a fatal signal, a thread
  that died, a power loss.
- `<state dir>/gpuwatchd-fault.log` is where `faulthandler` writes every
  thread's stack on SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE (a native
  library: NVML, SQLite, grpcio), and where the daemon writes the traceback
  of an uncaught exception. Each start keeps the previous file as `.1`.
- `<state dir>/unclean-restarts` counts the unclean ends seen, so that
  `gpuwatchd_unclean_restarts_total` only grows across restarts: a counter
  that restarts at 0 would read 1 after each of two crashes in a row, and
  Prometheus' `increase()` would see no second crash.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import stat
import sys
import time
from dataclasses import dataclass
from typing import IO

from gpuwatchd.model import Event, MetricSpec, Sample, Severity

__all__ = [
    "COUNT_NAME",
    "EVENT_KIND",
    "FAULT_LOG_NAME",
    "MARKER_NAME",
    "METRICS",
    "PreviousRun",
    "RunRecord",
    "tighten_state_dir",
]

log = logging.getLogger("gpuwatchd")

MARKER_NAME = "gpuwatchd.run"
FAULT_LOG_NAME = "gpuwatchd-fault.log"
COUNT_NAME = "unclean-restarts"
EVENT_KIND = "daemon_unclean_restart"
FAULT_LOG_MAX = 256 * 1024  # what the daemon itself appends (tracebacks), at most
STACK_LINES = 3  # of the previous fault log, in the one warning line
PRIVATE_FILES = (
    "gpuwatchd.db",
    "gpuwatchd.lock",
    MARKER_NAME,
    COUNT_NAME,
    FAULT_LOG_NAME,
    FAULT_LOG_NAME + ".1",
)
PRIVATE_TREES = ("evidence",)  # the evidence bundles (sinks/evidence.py): dirs 0700, files 0600

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_unclean_restarts_total",
        "counter",
        "Starts that found the previous run had not stopped cleanly (killed, a fatal"
        " signal, a thread that died, a power loss). Kept in the state dir, so it only"
        " grows across restarts; the event daemon_unclean_restart has the detail.",
    ),
)


@dataclass(frozen=True)
class PreviousRun:
    """The run before this one, when it did not stop cleanly."""

    pid: int
    boot_id: str
    started: float
    this_boot: bool
    stack: tuple[str, ...]  # the first lines of its fault log; () when it left none

    def describe(self) -> str:
        """One line for the log, the event and `check`."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started))
        where = "" if self.this_boot else " (before the last reboot)"
        if self.stack:
            how = "fault log: " + " | ".join(self.stack)
        else:
            how = "no stack in the fault log (killed, or a power loss)"
        return (
            f"the previous run (pid {self.pid}, started {when}{where}) did not stop cleanly; {how}"
        )

    def event(self, now: float) -> Event:
        return Event(
            kind=EVENT_KIND,
            source="daemon",
            time=now,
            message=self.describe(),
            severity=Severity.WARNING,
            attrs=(
                ("pid", str(self.pid)),
                ("previous_boot_id", self.boot_id),
                ("started", f"{self.started:.3f}"),
            ),
        )


class RunRecord:
    """The run marker, the fault log and the unclean restart count of one state dir."""

    def __init__(self, state_dir: str, boot_id: str) -> None:
        self.state_dir = state_dir
        self.boot_id = boot_id
        self.marker = os.path.join(state_dir, MARKER_NAME)
        self.fault_path = os.path.join(state_dir, FAULT_LOG_NAME)
        self.unclean_restarts = 0
        self.marker_problem = ""  # why the marker could not be written (a full disk); "" once it is
        self._mark = ""
        self._fault: IO[str] | None = None  # open for the life of the process
        self._fault_written = 0

    def begin(self, now: float) -> PreviousRun | None:
        """At start, with the state dir locked: read what the last run left, then mark this one."""
        previous = self._previous()
        self.unclean_restarts = _read_int(os.path.join(self.state_dir, COUNT_NAME))
        if previous is not None:
            self.unclean_restarts += 1
            _write_private(os.path.join(self.state_dir, COUNT_NAME), f"{self.unclean_restarts}\n")
        self._open_fault_log()
        mark = {"pid": os.getpid(), "boot_id": self.boot_id, "started": now}
        self._mark = json.dumps(mark) + "\n"
        self.marker_problem = _write_private(self.marker, self._mark)
        return previous

    def retry_marker(self) -> None:
        """Write the marker the disk refused at start (the daemon's housekeeping calls this)."""
        if self.marker_problem and self._mark:
            self.marker_problem = _write_private(self.marker, self._mark, quiet=True)
            if not self.marker_problem:
                log.info("run marker %s written: an unclean end is counted again", self.marker)

    def status(self) -> dict[str, str]:
        """/status: whether this run's marker is on disk (else an unclean end goes unseen)."""
        if not self.marker_problem:
            return {"run_marker": "written"}
        return {
            "run_marker": f"not written ({self.marker_problem}): if this run ends uncleanly,"
            " the next start will not know; retried"
        }

    def _previous(self) -> PreviousRun | None:
        try:
            with open(self.marker, encoding="utf-8", errors="replace") as f:
                text = f.read(4096)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the run marker %s: %s", self.marker, exc.strerror)
            return None
        try:
            mark = json.loads(text)
            pid, boot, started = int(mark["pid"]), str(mark["boot_id"]), float(mark["started"])
        except (ValueError, KeyError, TypeError):
            pid, boot, started = 0, "", 0.0  # torn by the crash itself: still an unclean end
        return PreviousRun(pid, boot, started, boot == self.boot_id, self._stack())

    def _stack(self) -> tuple[str, ...]:
        try:
            with open(self.fault_path, encoding="utf-8", errors="replace") as f:
                head = f.read(8192)
        except OSError:
            return ()
        lines = [line.strip() for line in head.splitlines() if line.strip()]
        return tuple(line[:200] for line in lines[:STACK_LINES])

    def _open_fault_log(self) -> None:
        """Keep the last run's fault log as .1, start an empty one, point faulthandler at it."""
        try:
            if os.path.getsize(self.fault_path) > 0:
                os.replace(self.fault_path, self.fault_path + ".1")
        except OSError:
            pass
        try:
            fd = os.open(
                self.fault_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
            )
            self._fault = os.fdopen(fd, "w", encoding="utf-8", errors="replace")
        except OSError as exc:
            # faulthandler holds one file for fatal signals; stderr is the next best.
            log.warning(
                "cannot open %s (%s): fatal-signal stacks go to stderr", self.fault_path, exc
            )
            faulthandler.enable(file=sys.stderr, all_threads=True)
            return
        faulthandler.enable(file=self._fault, all_threads=True)

    def fault(self, text: str) -> None:
        """Append a traceback to the fault log (bounded), for the next start to report."""
        if self._fault is None or self._fault_written >= FAULT_LOG_MAX:
            return
        text = text[: FAULT_LOG_MAX - self._fault_written]
        with contextlib.suppress(OSError, ValueError):
            self._fault.write(text)
            self._fault.flush()
            self._fault_written += len(text)

    def end_clean(self) -> None:
        """A clean stop: remove the marker (the fault log stays open until exit)."""
        try:
            os.unlink(self.marker)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the run marker %s: %s", self.marker, exc.strerror)

    def samples(self) -> list[Sample]:
        return [Sample.of("gpuwatchd_unclean_restarts_total", self.unclean_restarts)]


def _read_int(path: str) -> int:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(32).strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def _write_private(path: str, text: str, quiet: bool = False) -> str:
    """Write a small file 0600, atomically; a full or read-only disk is only a warning.

    Returns "" when written, else why not.
    """
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if not quiet:
            log.warning("cannot write %s: %s", path, exc.strerror or exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return str(exc.strerror or exc)
    return ""


def tighten_state_dir(path: str) -> None:
    """The event store holds command lines and stacks: nothing of it for other users.

    Files made group- or world-readable before (an older version, a hand start
    without the unit's UMask=0077) become 0600, the fault logs among them, and
    the evidence tree's directories 0700. A dir open to all users (a
    kubelet hostPath is created 0755) loses the bits for others when it is
    ours; the group's stay (the unit makes it 0750).
    """
    try:
        st = os.stat(path)
    except OSError:
        return
    if st.st_mode & stat.S_IRWXO:
        mode = stat.S_IMODE(st.st_mode)
        try:
            if st.st_uid != os.geteuid():
                raise PermissionError("not its owner")
            os.chmod(path, mode & ~stat.S_IRWXO)
            log.info("state dir %s was open to all users: mode %o now", path, mode & 0o770)
        except OSError as exc:
            log.warning("state dir %s is open to all users (mode %o): %s", path, mode, exc)
    for name in PRIVATE_FILES:
        for suffix in ("", "-wal", "-shm"):
            _private(os.path.join(path, name + suffix), 0o600)
    for tree in PRIVATE_TREES:
        root = os.path.join(path, tree)
        if not os.path.isdir(root) or os.path.islink(root):
            continue
        _private(root, 0o700)
        for where, dirs, files in os.walk(root):  # symlinks are not followed, nor changed
            for name in dirs:
                _private(os.path.join(where, name), 0o700)
            for name in files:
                _private(os.path.join(where, name), 0o600)


def _private(path: str, mode: int) -> None:
    """chmod `path` to `mode` when group or others have any access (a link: left alone)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            os.chmod(path, mode)
    except OSError:
        pass
