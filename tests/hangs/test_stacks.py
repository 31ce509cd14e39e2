"""py-spy capture of a real local Python process, and the messages when it cannot."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpuwatchd.sources.hangs import stacks

needs_py_spy = pytest.mark.skipif(stacks.find_py_spy() is None, reason="py-spy not installed")

WAITER = """
import queue, threading, sys
q = queue.Queue()
threading.Thread(target=q.get, name="loader", daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


@needs_py_spy
def test_capture_a_real_process_with_native_frames() -> None:
    cmd = [sys.executable, "-c", WAITER]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            time.sleep(0.2)
            cap = stacks.capture(p.pid, timeout=20)
        finally:
            p.kill()
    if not cap.ok and "CAP_SYS_PTRACE" in cap.error:
        pytest.skip("ptrace not allowed here")
    assert cap.ok, cap.error
    names = {t.name for t in cap.threads}
    assert {"MainThread", "loader"} <= names
    main = cap.main_thread()
    assert main is not None and any(f.function == "<module>" for f in main.frames)
    assert cap.seconds < 20


@needs_py_spy
def test_a_gone_process_is_reported_not_raised() -> None:
    with subprocess.Popen([sys.executable, "-c", "pass"]) as p:
        p.wait()
    cap = stacks.capture(p.pid, timeout=10)
    assert not cap.ok and str(p.pid) in cap.error


def test_missing_py_spy_says_how_to_install_it() -> None:
    cap = stacks.capture(1, py_spy="/nonexistent/py-spy")
    assert not cap.ok and "cannot run py-spy" in cap.error
    assert "CAP_SYS_PTRACE" in stacks._explain(5, "Error: Permission denied (os error 13)", 1)
