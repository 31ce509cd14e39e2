"""Start the diag worker in its own process group, read its measurements, cancel it.

Cancelling kills the whole group with SIGKILL: the CUDA contexts go with the
processes, so the GPUs are free again within seconds, and nothing the
worker had not yet reported is counted as a failure.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuwatchd.diag.worker.measure import Measurement

__all__ = ["PARENT_ENV", "WorkerOutcome", "WorkerRun", "worker_command"]

WORKER_MODULE = "gpuwatchd.diag.worker"
PARENT_ENV = "GPUWATCHD_DIAG_PARENT"  # our pid: the worker checks it outlived no parent
MAX_LINE = 1 << 20  # one measurement is a few hundred bytes
REAP_SECONDS = 5.0
DRAIN_SECONDS = 1.0  # reading on after the worker exited, for what it wrote before


def worker_command(
    tier: str, gpus: Sequence[int], python: str = "", backend: str = "auto", fake: str = ""
) -> list[str]:
    """The worker's command line (`python` defaults to this interpreter)."""
    argv = [python or sys.executable, "-m", WORKER_MODULE, "--tier", tier, "--backend", backend]
    if gpus:
        argv += ["--gpus", ",".join(str(g) for g in gpus)]
    if fake:
        argv += ["--fake", fake]
    return argv


@dataclass
class WorkerOutcome:
    """What the worker reported before it ended or was stopped."""

    measurements: list[Measurement] = field(default_factory=list)
    backend: str = ""
    cancelled: str = ""  # why the run was cancelled, else ""
    error: str = ""  # why the worker gave no complete answer, else ""
    seconds: float = 0.0
    freed_seconds: float = 0.0  # from the kill to the worker's exit


class WorkerRun:
    """One worker process; `run()` blocks, `cancel()` may be called from any thread."""

    def __init__(
        self,
        argv: Sequence[str],
        timeout: float,
        should_cancel: Callable[[int], str] | None = None,
        check_every: float = 0.5,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.timeout = timeout
        self.should_cancel = should_cancel
        self.check_every = check_every
        self.env = env
        self.pid: int | None = None
        self._cancel = threading.Event()
        self._reason = ""
        self._reaped = False  # its pid may name someone else's group once reaped

    def cancel(self, reason: str) -> None:
        """Stop the run at once (a job is starting, a signal); safe from a signal handler."""
        self._reason = self._reason or reason
        self._cancel.set()
        if self.pid is not None and not self._reaped:
            _kill_group(self.pid)  # now, not when the reading loop next looks

    def run(self) -> WorkerOutcome:
        """Start the worker and read it until it ends, times out or is cancelled."""
        out = WorkerOutcome()
        t0 = time.monotonic()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with tempfile.TemporaryDirectory(prefix="gpuwatchd-diag-") as tmp:
            if self.argv[0] != sys.executable:
                # Another interpreter (one with CuPy or PyTorch) sees this gpuwatchd
                # and nothing else of ours: only the package, through a link.
                os.symlink(_package_dir(), os.path.join(tmp, "gpuwatchd"))
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (tmp, env.get("PYTHONPATH", "")) if p
                )
            self._run(env, out)
        out.seconds = time.monotonic() - t0
        return out

    def _run(self, env: dict[str, str], out: WorkerOutcome) -> None:
        t0 = time.monotonic()
        env[PARENT_ENV] = str(os.getpid())  # the worker dies with us (PR_SET_PDEATHSIG)
        try:
            proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: one kill stops all of it
                env=env,
            )
        except OSError as exc:
            out.error = f"cannot start the diag worker: {exc}"
            return
        self.pid = proc.pid
        if self._cancel.is_set():  # cancelled (a signal) while it was being started
            _kill_group(proc.pid)
        pipes = _Pipes(proc)
        try:
            done = self._read(proc, pipes, out, t0 + self.timeout)
            if out.cancelled or out.error:
                kill_at = time.monotonic()
                _kill_group(proc.pid)
                _reap(proc)
                out.freed_seconds = time.monotonic() - kill_at
            else:
                try:
                    proc.wait(timeout=max(1.0, t0 + self.timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                if not done:
                    tail = " | ".join(pipes.errors[-3:])
                    code = proc.returncode
                    out.error = (
                        f"the diag worker exited {code} without finishing"
                        if code is not None
                        else f"the diag worker did not exit within {self.timeout:g}s"
                    ) + (f": {tail}" if tail else "")
        finally:
            # Whatever ended the run (an exception, a signal's KeyboardInterrupt): the
            # group goes, and the read ends close at once. A child that left the group
            # (setsid) and holds the pipes is not waited for: it gets EPIPE when it writes.
            _kill_group(proc.pid)
            _reap(proc)
            self._reaped = proc.returncode is not None
            pipes.close()

    def _read(
        self, proc: subprocess.Popen[bytes], pipes: _Pipes, out: WorkerOutcome, deadline: float
    ) -> bool:
        """Read until the final line, the worker's exit, the deadline or a cancel; True if done."""
        next_check = time.monotonic()
        exited_at: float | None = None
        while True:
            if self._cancel.is_set():
                out.cancelled = self._reason or "cancelled"
                return False
            now = time.monotonic()
            if now >= deadline:
                out.error = f"the diag worker did not finish within {self.timeout:g}s"
                return False
            if self.should_cancel is not None and now >= next_check:
                next_check = now + self.check_every
                reason = self.should_cancel(proc.pid)
                if reason:
                    out.cancelled = reason
                    return False
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            wait = 0.0 if exited_at else min(self.check_every, max(0.01, deadline - now))
            for line in pipes.read(wait):
                if self._take(line, out):
                    return True
            # Gone, and what it wrote is read: its output ended with it, whoever still
            # holds the pipes (a child that called setsid keeps them open, and may write).
            if exited_at is not None and (
                not pipes.pending(0.05) or time.monotonic() - exited_at > DRAIN_SECONDS
            ):
                return False
            if pipes.eof:  # both ends closed, the worker not gone yet: wait for it, briefly
                try:
                    proc.wait(timeout=min(self.check_every, max(0.01, deadline - now)))
                except subprocess.TimeoutExpired:
                    pass

    @staticmethod
    def _take(line: str, out: WorkerOutcome) -> bool:
        """Parse one line into `out`; True on the final line."""
        try:
            data = json.loads(line)
        except ValueError:
            return False  # a library printed something of its own
        if not isinstance(data, dict):
            return False
        if data.get("done"):
            return True
        if "fatal" in data:
            out.error = str(data["fatal"])
            return False
        if "hello" in data and isinstance(data["hello"], dict):
            out.backend = str(data["hello"].get("backend", ""))
            return False
        try:
            out.measurements.append(Measurement.from_json(data))
        except ValueError:
            pass
        return False


def _package_dir() -> str:
    import gpuwatchd

    return os.path.dirname(os.path.abspath(gpuwatchd.__file__))


class _Pipes:
    """The worker's stdout and stderr, read without blocking from the thread that runs it.

    No reader threads: closing is immediate whoever else holds the write ends.
    A line longer than MAX_LINE is dropped, so a runaway worker cannot grow memory.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._sel = selectors.DefaultSelector()
        self._files = [f for f in (proc.stdout, proc.stderr) if f is not None]
        self._partial: dict[int, bytes] = {}
        self.errors: list[str] = []  # the last lines of stderr
        for f in self._files:
            os.set_blocking(f.fileno(), False)
            self._sel.register(f.fileno(), selectors.EVENT_READ, f is proc.stdout)
            self._partial[f.fileno()] = b""

    @property
    def eof(self) -> bool:
        """Both pipes ended."""
        return not self._sel.get_map()

    def pending(self, timeout: float) -> bool:
        """Whether a pipe has something (data or its end) to read within `timeout`."""
        return bool(self._sel.get_map()) and bool(self._sel.select(timeout))

    def read(self, timeout: float) -> list[str]:
        """Complete stdout lines that arrived within `timeout` (stderr goes to `errors`)."""
        lines: list[str] = []
        if self.eof:
            return lines
        for key, _ in self._sel.select(timeout):
            fd, is_stdout = key.fd, bool(key.data)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self._sel.unregister(fd)
            buf = self._partial[fd] + chunk
            *complete, rest = buf.split(b"\n")
            if not chunk and rest:
                complete.append(rest)
                rest = b""
            self._partial[fd] = rest if len(rest) <= MAX_LINE else b""
            for raw in complete:
                text = raw.decode("utf-8", "replace").strip()
                if is_stdout:
                    lines.append(text)
                elif text:
                    self.errors.append(text[:300])
                    del self.errors[:-20]
        return lines

    def close(self) -> None:
        """Close the read ends now (no thread is blocked on them)."""
        self._sel.close()
        for f in self._files:
            f.close()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a killed worker; SIGKILL ends it unless it is stuck in the kernel."""
    try:
        proc.wait(timeout=REAP_SECONDS)
    except subprocess.TimeoutExpired:
        pass  # in uninterruptible sleep (a driver call): the kernel ends it later


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
