"""The idle H100 capture against nvidia-smi's own output, recorded on the same machine.

`nvidia-smi -q` and `nvidia-smi --query-gpu=<every field>` were saved a
second before `h100-idle-record.json` was recorded (tests/gpu/nvml_device_run.sh);
the GPU was idle, so every value nvidia-smi has must agree with what the
NVML source makes of the capture, with the comparison script's own rules.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from gpuwatchd.model import Sample
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource

ROOT = Path(__file__).resolve().parents[2]
NVML = ROOT / "tests" / "fixtures" / "nvml"


def compare_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "compare_nvidia_smi", ROOT / "tests" / "gpu" / "compare_nvidia_smi.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_idle_capture_agrees_with_nvidia_smi() -> None:
    compare = compare_script()
    q = compare.parse_q((NVML / "source" / "h100-nvidia-smi-q-idle.txt").read_text())
    with (NVML / "source" / "h100-nvidia-smi-query-gpu-idle.csv").open() as f:
        rows = list(csv.reader(f, skipinitialspace=True))
    fields = [h.split(" [")[0] for h in rows[0]]  # "memory.used [MiB]" -> "memory.used"
    query = {}
    for values in rows[1:]:
        row = dict(zip(fields, values, strict=True))
        # the saved CSV carries units ("0 MiB", "345 MHz"); the script parses the number
        query[normalize_bus_id(row["pci.bus_id"])] = row
    source = NvmlSource(ReplayClient.load(NVML / "h100-idle-record.json"), call_timeout=2.0)
    try:
        source.poll(0.0)
        samples = [s for s in source.poll(0.0) if isinstance(s, Sample)]
    finally:
        source.close()
    results = compare.compare(samples, query, q, set(fields))
    verdicts = {r["metric"]: r["verdict"] for r in results}
    assert [m for m, v in verdicts.items() if v in ("MISMATCH", "missing in gpuwatchd")] == []
    agreed = {m for m, v in verdicts.items() if v == "agree"}
    for metric in (
        "gpuwatchd_gpu_memory_used_bytes",
        "gpuwatchd_gpu_memory_reserved_bytes",
        "gpuwatchd_gpu_memory_free_bytes",
        "gpuwatchd_gpu_memory_capacity_bytes",
        'gpuwatchd_gpu_clock_hertz{clock="sm"}',
        'gpuwatchd_gpu_clock_max_hertz{clock="memory"}',
        'gpuwatchd_gpu_clock_application_hertz{clock="graphics"}',
        "gpuwatchd_gpu_performance_state",
        'gpuwatchd_gpu_temperature_threshold_celsius{threshold="slowdown"}',
        'gpuwatchd_gpu_clock_event_seconds_total{reason="sw_power_cap"}',
        'gpuwatchd_gpu_clock_event_active{reason="gpu_idle"}',
        'gpuwatchd_gpu_ecc_errors_total{error="uncorrected",scope="aggregate"}',
    ):
        assert metric in agreed, (metric, verdicts.get(metric))
    assert len(agreed) >= 50
