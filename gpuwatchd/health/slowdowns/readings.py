"""One poll of one GPU as the slowdown detector reads it, from the NVML source's samples.

Compute activity is GPM's SM activity where the GPU has GPM (Hopper and later);
without it, power against the limit stands in (a rank spinning in an NCCL kernel
draws far less than one in matmuls; utilization cannot tell the two apart).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuwatchd.model import Sample

__all__ = ["GpuPace", "SLOWING_REASONS", "paces_from_samples"]

# Clock event reasons that slow a busy GPU down (not idle, not a setting the site chose).
SLOWING_REASONS = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)


@dataclass(frozen=True, slots=True)
class GpuPace:
    """What one GPU showed at one poll; None = not read on this GPU."""

    gpu: str
    utilization: float | None = None
    sm_active: float | None = None
    tensor_active: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_hz: float | None = None
    sm_clock_max_hz: float | None = None
    clock_events: frozenset[str] = frozenset()  # the slowing reasons set now
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_generation: int | None = None
    pcie_generation_max: int | None = None
    nvlink_errors: float | None = None  # replay + recovery + crc over its links (counter)
    ecc_corrected: float | None = None  # volatile corrected ECC errors (counter)

    def compute(self) -> float | None:
        """Compute activity 0..1: SM activity (GPM), else power over its limit."""
        if self.sm_active is not None:
            return self.sm_active
        if self.power_watts is not None and self.power_limit_watts:
            return self.power_watts / self.power_limit_watts
        return None


_FLOAT = {
    "gpuwatchd_gpu_sm_active_ratio": "sm_active",
    "gpuwatchd_gpu_power_watts": "power_watts",
    "gpuwatchd_gpu_power_limit_watts": "power_limit_watts",
}


def paces_from_samples(samples: Iterable[Sample]) -> list[GpuPace]:
    """Each GPU's pace fields from one NVML poll's samples (GPU order as NVML's)."""
    per: dict[str, dict[str, object]] = {}
    events: dict[str, set[str]] = {}
    for s in samples:
        gpu = s.label("gpu")
        if not gpu or s.label("mig_uuid"):
            continue
        f = per.setdefault(gpu, {})
        name = s.name
        if name in _FLOAT:
            f[_FLOAT[name]] = s.value
        elif name == "gpuwatchd_gpu_utilization_ratio":
            if s.label("engine") != "memory":
                f["utilization"] = s.value
        elif name == "gpuwatchd_gpu_pipe_active_ratio":
            if s.label("pipe") == "tensor":
                f["tensor_active"] = s.value
        elif name == "gpuwatchd_gpu_clock_hertz":
            if s.label("clock") == "sm":
                f["sm_clock_hz"] = s.value
        elif name == "gpuwatchd_gpu_clock_max_hertz":
            if s.label("clock") == "sm":
                f["sm_clock_max_hz"] = s.value
        elif name == "gpuwatchd_gpu_clock_event_active":
            if s.value and s.label("reason") in SLOWING_REASONS:
                events.setdefault(gpu, set()).add(s.label("reason"))
        elif name in ("gpuwatchd_gpu_pcie_link_width", "gpuwatchd_gpu_pcie_link_generation"):
            key = "pcie_width" if name.endswith("width") else "pcie_generation"
            f[key if s.label("which") == "current" else f"{key}_max"] = int(s.value)
        elif name == "gpuwatchd_nvlink_errors_total":
            f["nvlink_errors"] = float(f.get("nvlink_errors", 0.0)) + s.value  # type: ignore[arg-type]
        elif name == "gpuwatchd_gpu_ecc_errors_total":
            if s.label("error") == "corrected" and s.label("scope") == "volatile":
                f["ecc_corrected"] = s.value
    return [
        GpuPace(gpu, clock_events=frozenset(events.get(gpu, ())), **fields)  # type: ignore[arg-type]
        for gpu, fields in per.items()
    ]
