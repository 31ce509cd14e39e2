"""The dcgm tier: NVIDIA DCGM's own diagnostic (`dcgmi diag -r N`), its verdict folded in."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

from gpuwatchd.diag.worker.measure import Measurement

__all__ = ["parse_dcgmi", "run_dcgmi"]


def _statuses(node: object, name: str = "") -> Iterator[tuple[str, str]]:
    """(test name, status) for every result object in dcgmi's JSON, whatever its nesting."""
    if isinstance(node, dict):
        here = str(node.get("name") or node.get("test_name") or name)
        status = node.get("status")
        if isinstance(status, str):
            yield here, status.strip().lower()
        for value in node.values():
            yield from _statuses(value, here)
    elif isinstance(node, list):
        for value in node:
            yield from _statuses(value, name)


def parse_dcgmi(text: str, returncode: int, level: int) -> Measurement:
    """One `dcgm` measurement from dcgmi's JSON output and exit status."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if data is None:
        why = text.strip().splitlines()[-1][:300] if text.strip() else f"exit {returncode}"
        return Measurement("dcgm", "all", None, "tests", error=f"dcgmi diag: {why}")
    results = list(_statuses(data))
    failed = sorted({n for n, s in results if s.startswith("fail")})
    passed = sum(1 for _, s in results if s.startswith("pass"))
    warned = sorted({n for n, s in results if s.startswith("warn")})
    if not results:
        return Measurement("dcgm", "all", None, "tests", error="dcgmi diag: no results in output")
    detail = f"level {level}: {passed} passed"
    if failed:
        detail += ", failed: " + ", ".join(failed)
    if warned:
        detail += ", warned: " + ", ".join(warned)
    return Measurement(
        "dcgm", "all", float(len(failed)), "tests", correct=not failed, detail=detail
    )


def run_dcgmi(level: int, timeout: float) -> Measurement:
    """Run `dcgmi diag -r LEVEL -j`; skipped (not failed) where DCGM is not installed."""
    exe = shutil.which("dcgmi")
    if exe is None:
        return Measurement("dcgm", "all", None, "skipped", detail="dcgmi not installed")
    try:
        proc = subprocess.Popen(
            [exe, "diag", "-r", str(level), "-j"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        return Measurement("dcgm", "all", None, "tests", error=f"dcgmi: {exc}")
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return Measurement("dcgm", "all", None, "tests", error=f"dcgmi diag ran over {timeout:g}s")
    finally:  # a timeout, or an interrupt (a signal) of the command that started it
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return parse_dcgmi(text, proc.returncode, level)
