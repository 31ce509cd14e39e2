"""Start the diag worker in its own process group, read its measurements, cancel it.

Cancelling kills the whole group with SIGKILL: the CUDA contexts go with the
processes, so the GPUs are free again within seconds, and nothing the
worker had not yet reported is counted as a failure.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuwatchd.diag.measure import Measurement

__all__ = ["WorkerOutcome", "WorkerRun", "worker_command"]

WORKER_MODULE = "gpuwatchd.diag.worker"


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

    def cancel(self, reason: str) -> None:
        """Stop the run at once (a job is starting on the node)."""
        self._reason = self._reason or reason
        self._cancel.set()

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
        try:
            proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: one kill stops all of it
                env=env,
                text=True,
            )
        except OSError as exc:
            out.error = f"cannot start the diag worker: {exc}"
            return
        self.pid = proc.pid
        lines: queue.Queue[str | None] = queue.Queue()
        errors: list[str] = []
        readers = [
            threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True),
            threading.Thread(target=_tail, args=(proc.stderr, errors), daemon=True),
        ]
        for reader in readers:
            reader.start()
        done = False
        deadline = t0 + self.timeout
        next_check = t0
        while True:
            if self._cancel.is_set():
                out.cancelled = self._reason or "cancelled"
                break
            now = time.monotonic()
            if now >= deadline:
                out.error = f"the diag worker did not finish within {self.timeout:g}s"
                break
            if self.should_cancel is not None and now >= next_check:
                next_check = now + self.check_every
                reason = self.should_cancel(proc.pid)
                if reason:
                    out.cancelled = reason
                    break
            try:
                line = lines.get(timeout=min(self.check_every, max(0.01, deadline - now)))
            except queue.Empty:
                continue
            if line is None:  # the worker closed its output: it is ending
                break
            done = self._take(line, out) or done
        if out.cancelled or out.error:
            kill_at = time.monotonic()
            _kill_group(proc.pid)
            proc.wait()
            out.freed_seconds = time.monotonic() - kill_at
        else:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
            if not done and not out.error:
                tail = " | ".join(errors[-3:])
                out.error = out.error or (
                    f"the diag worker exited {proc.returncode} without finishing"
                    + (f": {tail}" if tail else "")
                )
        _kill_group(proc.pid)  # anything it left behind in its group
        for reader in readers:
            reader.join(2.0)  # the pipes end with the group
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

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


def _pump(stream: object, lines: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put(None)


def _tail(stream: object, sink: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        if line.strip():
            sink.append(line.strip()[:300])
            del sink[:-20]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
