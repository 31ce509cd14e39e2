"""Canned diag worker scripts (the worker's test-only --fake mode) and process probes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tests.conftest import FIXTURES

H100_IDLE = FIXTURES / "nvml" / "h100-idle-record.json"


def canned(tmp_path: Path, lines: Iterable[Mapping[str, Any]], name: str = "worker.jsonl") -> str:
    """Write a fake worker script; return its path."""
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def result(check: str, gpu: str, value: float, unit: str, **kw: Any) -> dict[str, Any]:
    return {"check": check, "gpu": gpu, "value": value, "unit": unit, **kw}


HEALTHY_H100 = [
    {"hello": {"backend": "fake", "devices": 1}},
    result("gemm", "0", 790.0, "TFLOP/s", detail="bf16"),
    result("h2d_bandwidth", "0", 52.0, "GB/s"),
    result("d2d_bandwidth", "0", 3000.0, "GB/s"),
]
# The standard tier on the one H100: the quick checks and the memory pattern pass
# (a single GPU has no peer pair and no all-reduce).
HEALTHY_H100_STANDARD = [*HEALTHY_H100, result("memory_pattern", "0", 0.0, "words")]


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def capture_with_script(tmp_path: Path, script: list[dict[str, Any]]) -> str:
    """The idle H100 capture with a replay script added (for --nvml-replay)."""
    data = json.loads(H100_IDLE.read_text())
    data["script"] = [*data.get("script", []), *script]
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(data))
    return str(path)


def env_without_dcgmi(tmp_path: Path) -> dict[str, str]:
    """PATH without dcgmi (the dcgm tier must then say UNKNOWN)."""
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    return {**os.environ, "PATH": str(empty)}
