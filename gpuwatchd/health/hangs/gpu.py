"""A GPU's activity as the hang detector reads it: one poll, its class, the job's baseline.

GPU readings only support a verdict: a rank spinning on a dead peer over NVLink
reads NVML utilisation 0 %, SM activity 18 %, occupancy 5 % and 122-125 W,
while the same job training read SM activity 92 % at 625 W. So a rank "works"
when its GPU runs near the job's own peak (GPM SM activity, else power), and
"spins" (legacy single-kernel stand-in) when utilisation is high with the SMs
idle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuwatchd.config import Config
from gpuwatchd.model import Sample

__all__ = [
    "GpuActivity",
    "GpuBaseline",
    "HangThresholds",
    "activity_from_samples",
    "classify",
    "thresholds_from_config",
]

UTIL = "gpuwatchd_gpu_utilization_ratio"
POWER = "gpuwatchd_gpu_power_watts"
POWER_LIMIT = "gpuwatchd_gpu_power_limit_watts"
SM_ACTIVE = "gpuwatchd_gpu_sm_active_ratio"
SM_OCCUPANCY = "gpuwatchd_gpu_sm_occupancy_ratio"
DRAM_ACTIVE = "gpuwatchd_gpu_dram_active_ratio"
NVLINK_BYTES = "gpuwatchd_gpu_nvlink_bytes_per_second"
MIN_NVLINK_PEAK = 1e9  # a job that never moved 1 GB/s over NVLink: no baseline to judge by


@dataclass(frozen=True, slots=True)
class HangThresholds:
    """When a job counts as hung; defaults match config.HangsConfig."""

    decide_after_seconds: float = 45.0  # cpu_stall, gpu_stall
    straggler_after_seconds: float = 60.0
    rank_missing_after_seconds: float = 10.0
    remote_rank_missing_after_seconds: float = 10.0  # the rendezvous, stacks shown (early.py)
    kernel_stuck_after_seconds: float = 10.0  # a kernel never completes, stacks shown
    dead_peer_after_seconds: float = 10.0
    ras_wait_seconds: float = 20.0  # how long a death waits for a RAS answer at most
    collective_stall_seconds: float = 30.0  # RAS counts flat this long
    collective_deadlock_seconds: float = 15.0  # the same, RAS showing why none can complete
    collective_timeout_seconds: float = 600.0  # a straggler pages when it lasts this long
    startup_grace_seconds: float = 30.0
    progress_window_seconds: float = 15.0
    io_progress_bytes_per_second: float = 65536.0
    child_cpu_ratio: float = 0.2
    waiting_cpu_ratio: float = 0.3
    work_ratio: float = 0.5
    min_work_sm_active: float = 0.3
    min_work_power_ratio: float = 0.4
    resident_sm_active: float = 0.05
    busy_utilization: float = 0.95
    idle_utilization: float = 0.05
    max_sm_active: float = 0.05
    max_sm_occupancy: float = 0.05
    max_memory_utilization: float = 0.02
    max_power_ratio: float = 0.3
    fallback_max_power_watts: float = 150.0
    max_cpu_ratio: float = 0.05
    max_gap_seconds: float = 30.0
    single_process_cpu_stall: bool = False
    await_ras: bool = False  # RAS is polled: a distributed job's CPU or GPU stall waits for it


@dataclass(frozen=True, slots=True)
class GpuActivity:
    """One poll of one GPU; None = not read (GPM fields are None where unsupported)."""

    gpu: str
    utilization: float | None
    memory_utilization: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    dram_active: float | None = None
    nvlink_bytes_per_second: float | None = None  # rx + tx (GPM)


def classify(g: GpuActivity | None, t: HangThresholds) -> tuple[str, str]:
    """('spin' | 'idle' | 'busy' | 'unknown', which signals decided)."""
    if g is None or g.utilization is None:
        return "unknown", ""
    if g.sm_active is not None and g.sm_occupancy is not None:
        if g.utilization >= t.busy_utilization and (
            g.sm_active <= t.max_sm_active and g.sm_occupancy <= t.max_sm_occupancy
        ):
            return "spin", "gpm"
        if g.utilization <= t.idle_utilization:
            return "idle", "utilization"
        return "busy", "gpm"
    if g.utilization <= t.idle_utilization:
        return "idle", "utilization"
    if g.utilization < t.busy_utilization or g.memory_utilization is None:
        return "busy", "utilization"
    if g.power_watts is None:
        return "unknown", ""
    limit = (
        t.max_power_ratio * g.power_limit_watts
        if g.power_limit_watts
        else t.fallback_max_power_watts
    )
    if g.memory_utilization <= t.max_memory_utilization and g.power_watts <= limit:
        return "spin", "power+memory"
    return "busy", "power+memory"


class GpuBaseline:
    """Per GPU, the peak SM activity and power seen, decaying slowly (halves in ~30 min).

    `working()` says whether a reading is near that peak: the job's own level of
    real work, not a fixed utilisation threshold.
    """

    HALF_LIFE = 1800.0

    def __init__(self) -> None:
        self._peak: dict[str, tuple[float, float, float]] = {}  # gpu -> (t, sm, watts)
        self._link: dict[str, float] = {}  # gpu -> peak NVLink bytes/s (same decay)

    def update(self, g: GpuActivity, now: float) -> None:
        """Fold one reading into the GPU's peaks."""
        t0, sm, watts = self._peak.get(g.gpu, (now, 0.0, 0.0))
        decay = 0.5 ** (max(0.0, now - t0) / self.HALF_LIFE)
        link = self._link.get(g.gpu, 0.0) * decay
        self._link[g.gpu] = max(link, g.nvlink_bytes_per_second or 0.0)
        self._peak[g.gpu] = (
            now,
            max(sm * decay, g.sm_active or 0.0),
            max(watts * decay, g.power_watts or 0.0),
        )

    def working(self, g: GpuActivity | None, t: HangThresholds) -> bool | None:
        """True near the peak, False well below it, None when nothing says."""
        if g is None:
            return None
        _, sm_peak, watts_peak = self._peak.get(g.gpu, (0.0, 0.0, 0.0))
        link_peak = self._link.get(g.gpu, 0.0)
        if g.nvlink_bytes_per_second is not None and link_peak >= MIN_NVLINK_PEAK:
            if g.nvlink_bytes_per_second >= t.work_ratio * link_peak:
                return True  # moving data with its peers at the job's own pace
        if g.sm_active is not None:
            floor = t.min_work_sm_active
            return g.sm_active >= max(floor, t.work_ratio * sm_peak)
        if g.power_watts is not None and g.power_limit_watts:
            floor = t.min_work_power_ratio * g.power_limit_watts
            return g.power_watts >= max(floor, t.work_ratio * watts_peak)
        return None

    def fallen(self, g: GpuActivity | None, t: HangThresholds) -> bool:
        """A kernel resident, far below a peak of real work this GPU showed before."""
        if g is None or not self.resident(g, t) or self.working(g, t) is not False:
            return False
        _, sm_peak, _ = self._peak.get(g.gpu, (0.0, 0.0, 0.0))
        return sm_peak >= t.min_work_sm_active or self._link.get(g.gpu, 0.0) >= MIN_NVLINK_PEAK

    def resident(self, g: GpuActivity | None, t: HangThresholds) -> bool:
        """A kernel sits on the GPU without working (a collective waiting for a peer)."""
        if g is None:
            return False
        if classify(g, t)[0] == "spin":
            return True
        return g.sm_active is not None and g.sm_active >= t.resident_sm_active


def activity_from_samples(samples: Iterable[Sample]) -> list[GpuActivity]:
    """GPU activity from the NVML source's samples (GPM series when present)."""
    per: dict[str, dict[str, float]] = {}
    keys = {
        POWER: "power",
        POWER_LIMIT: "limit",
        SM_ACTIVE: "sm",
        SM_OCCUPANCY: "occ",
        DRAM_ACTIVE: "dram",
    }
    for s in samples:
        gpu = s.label("gpu")
        if not gpu:
            continue
        if s.name == UTIL:
            key = "mem" if s.label("engine") == "memory" else "util"
        elif s.name == NVLINK_BYTES:
            per.setdefault(gpu, {})["nvlink"] = per.get(gpu, {}).get("nvlink", 0.0) + s.value
            continue
        elif s.name in keys:
            key = keys[s.name]
        else:
            continue
        per.setdefault(gpu, {})[key] = s.value
    return [
        GpuActivity(
            gpu,
            v.get("util"),
            v.get("mem"),
            v.get("power"),
            v.get("limit"),
            v.get("sm"),
            v.get("occ"),
            v.get("dram"),
            v.get("nvlink"),
        )
        for gpu, v in sorted(per.items())
    ]


def thresholds_from_config(cfg: Config) -> HangThresholds:
    """The detector's thresholds from the `hangs:` section."""
    h = cfg.hangs
    return HangThresholds(
        decide_after_seconds=h.decide_after_seconds,
        rank_missing_after_seconds=h.rank_missing_after_seconds,
        remote_rank_missing_after_seconds=h.remote_rank_missing_after_seconds,
        kernel_stuck_after_seconds=h.kernel_stuck_after_seconds,
        dead_peer_after_seconds=h.dead_peer_after_seconds,
        collective_stall_seconds=h.collective_stall_seconds,
        collective_deadlock_seconds=h.collective_deadlock_seconds,
        straggler_after_seconds=h.straggler_after_seconds,
        collective_timeout_seconds=h.collective_timeout_seconds,
        startup_grace_seconds=h.startup_grace_seconds,
        io_progress_bytes_per_second=h.io_progress_bytes_per_second,
        max_sm_active=h.max_sm_active,
        max_sm_occupancy=h.max_sm_occupancy,
        max_cpu_ratio=h.max_cpu_ratio,
        single_process_cpu_stall=h.single_process_cpu_stall,
        await_ras=h.ras and h.ras_poll,
    )
