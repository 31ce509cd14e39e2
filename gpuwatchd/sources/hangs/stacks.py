"""Python and native stacks of a process, from `py-spy dump --native`.

py-spy (the optional extra `gpuwatchd[hangs]`) reads another process's
memory: it needs CAP_SYS_PTRACE, or the same user with ptrace allowed
(kernel.yama.ptrace_scope 0). `capture()` runs it with a deadline and says
in plain words when it cannot; `parse_dump()` turns its text into frames
per thread.
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import time

from gpuwatchd.jobview import Frame, StackCapture, ThreadStack

__all__ = [
    "Frame",
    "StackCapture",
    "ThreadStack",
    "capture",
    "find_py_spy",
    "parse_dump",
]

_THREAD = re.compile(
    r'^Thread (?P<tid>0x[0-9a-fA-F]+|\d+)(?: \((?P<state>[^)]*)\))?(?:: "(?P<name>.*)")?\s*$'
)
_FRAME = re.compile(r"^\s+(?P<func>.+?)(?: \((?P<where>[^()]*)\))?\s*$")
_PROCESS = re.compile(r"^Process (?P<pid>\d+): (?P<cmd>.*)$")
_PYTHON = re.compile(r"^Python v(?P<version>\S+)")


def parse_dump(text: str) -> tuple[str, tuple[ThreadStack, ...]]:
    """(python version, threads) from `py-spy dump` text; unknown lines are skipped."""
    version = ""
    threads: list[ThreadStack] = []
    current: dict[str, str] | None = None
    frames: list[Frame] = []

    def close() -> None:
        if current is not None:
            threads.append(
                ThreadStack(current["tid"], current["name"], current["state"], tuple(frames))
            )

    for line in text.splitlines():
        if not line.strip():
            continue
        if m := _PYTHON.match(line):
            version = m.group("version")
            continue
        if _PROCESS.match(line):
            continue
        if m := _THREAD.match(line):
            close()
            current = {
                "tid": m.group("tid"),
                "name": m.group("name") or "",
                "state": m.group("state") or "",
            }
            frames = []
            continue
        if current is not None and line[:1] in (" ", "\t"):
            fm = _FRAME.match(line)
            if fm and not line.strip().startswith(("Arguments:", "Locals:")):
                frames.append(Frame(fm.group("func").strip(), (fm.group("where") or "").strip()))
    close()
    return version, tuple(threads)


def find_py_spy() -> str | None:
    """py-spy beside this Python (the optional extra installs it there), else on PATH."""
    import os

    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


_NO_PERMISSION = (
    "py-spy may not read pid {pid}: grant the daemon CAP_SYS_PTRACE (systemd: "
    "AmbientCapabilities=CAP_SYS_PTRACE; Kubernetes: securityContext.capabilities.add "
    "[SYS_PTRACE] and hostPID) or run it as the job's user with ptrace_scope 0"
)


def _explain(pid: int, stderr: str, rc: int) -> str:
    low = stderr.lower()
    if "permission denied" in low or "operation not permitted" in low or "eperm" in low:
        return _NO_PERMISSION.format(pid=pid)
    if "no such process" in low or "failed to find process" in low:
        return f"pid {pid} is gone"
    first = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "")
    return f"py-spy failed on pid {pid} (exit {rc}): {first[:200]}"


def capture(
    pid: int, *, native: bool = True, timeout: float = 10.0, py_spy: str | None = None
) -> StackCapture:
    """Run `py-spy dump [--native] --pid PID` within `timeout` seconds."""
    exe = py_spy or find_py_spy()
    if exe is None:
        return StackCapture(
            pid, False, error="py-spy is not installed (pip install 'gpuwatchd[hangs]')"
        )
    cmd = [exe, "dump", "--pid", str(pid)]
    if native:
        cmd.append("--native")
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return StackCapture(
            pid,
            False,
            error=f"py-spy did not finish within {timeout:g} s on pid {pid}",
            seconds=time.monotonic() - start,
        )
    except OSError as e:
        return StackCapture(pid, False, error=f"cannot run py-spy: {e}")
    seconds = time.monotonic() - start
    out = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        err = _explain(pid, done.stderr.decode(errors="replace"), done.returncode)
        return StackCapture(pid, False, error=err, seconds=seconds, raw=out)
    version, threads = parse_dump(out)
    return StackCapture(pid, True, threads, python=version, seconds=seconds, raw=out)


def children_max_rss_bytes() -> int:
    """Peak RSS of any child this process waited for (py-spy's memory, in benchmarks)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
