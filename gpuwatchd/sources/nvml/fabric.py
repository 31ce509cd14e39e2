"""GPU fabric (NVSwitch) registration, and the nvidia-fabricmanager service.

Per GPU, `gpu_fabric_info` (nvmlDeviceGetGpuFabricInfoV) says whether the
GPU has registered with the NVLink fabric: state not started, in progress
or completed, the registration's NVML status, its clique id and cluster
UUID, and a health mask. A GPU with no NVSwitch fabric answers
NOT_SUPPORTED (or state "not supported"): then nothing is exported.

On the node, the `nvidia-fabricmanager` unit's state is read with
`systemctl show` (read-only, under a deadline, at most once a minute);
where systemd or the unit is absent nothing is exported.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping

from gpuwatchd.model import MetricSpec, MetricType
from gpuwatchd.sources.nvml.client import code_name

__all__ = [
    "FABRIC_HEALTH_BITS",
    "FABRIC_METRICS",
    "FABRIC_STATES",
    "FabricManagerProbe",
    "read_fabric",
]

log = logging.getLogger("gpuwatchd.nvml")

Get = Callable[..., object | None]
Put = Callable[..., None]

FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
# NVML_GPU_FABRIC_HEALTH_MASK_*: (shift, condition); each 2-bit field is
# 0 not supported, 1 true, 2 false
FABRIC_HEALTH_BITS = {
    0: "degraded_bandwidth",
    2: "route_recovery",
    4: "route_unhealthy",
    6: "access_timeout_recovery",
}


def read_fabric(get: Get, put: Put, last: dict[str, object]) -> bool | None:
    """Fabric state, status and health of one GPU, where it has a fabric.

    Returns False when NVML answered that the GPU has no fabric (state "not
    supported", which does not change), None when it gave no answer.
    """
    info = get("gpu_fabric_info")
    if not isinstance(info, dict):
        return None
    state = info.get("state")
    if not isinstance(state, int):
        return None
    if state == 0:
        return False
    status = info.get("status")
    status_name = "SUCCESS" if status == 0 else code_name(int(status or -1))
    put("gpuwatchd_gpu_fabric_state", state)
    put(
        "gpuwatchd_gpu_fabric_info",
        1,
        state=FABRIC_STATES.get(state, "unknown"),
        status=status_name.lower(),
        clique_id=str(info.get("clique_id", "")),
        cluster_uuid=str(info.get("cluster_uuid", "")),
    )
    last["fabric"] = {"state": FABRIC_STATES.get(state, "unknown"), "status": status_name}
    mask = info.get("health_mask")
    if isinstance(mask, int):
        for shift, condition in FABRIC_HEALTH_BITS.items():
            bits = (mask >> shift) & 0x3
            if bits in (1, 2):
                put("gpuwatchd_gpu_fabric_health_issue", 1 if bits == 1 else 0, issue=condition)
    return True


_UNIT = "nvidia-fabricmanager.service"


class FabricManagerProbe:
    """The nvidia-fabricmanager unit's state from `systemctl show`, cached a minute."""

    def __init__(
        self,
        run: Callable[[list[str], float], str] | None = None,
        every: float = 60.0,
        timeout: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run or _systemctl
        self._every = every
        self._timeout = timeout
        self._monotonic = monotonic
        self._next = float("-inf")
        self._state: Mapping[str, str] | None = None

    def state(self) -> Mapping[str, str] | None:
        """LoadState/ActiveState/SubState, or None when the unit is not installed."""
        now = self._monotonic()
        if now < self._next:
            return self._state
        self._next = now + self._every
        args = ["show", _UNIT, "--property=LoadState,ActiveState,SubState,Result"]
        try:
            text = self._run(args, self._timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("systemctl show %s: %s", _UNIT, exc)
            self._state = None
            return None
        props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        if props.get("LoadState", "not-found") in ("not-found", ""):
            self._state = None
        else:
            self._state = props
        return self._state

    def samples(self, put: Put) -> None:
        """gpuwatchd_fabricmanager_up and its state info, where the unit exists."""
        state = self.state()
        if state is None:
            return
        active = state.get("ActiveState", "")
        put("gpuwatchd_fabricmanager_up", 1 if active == "active" else 0)
        put(
            "gpuwatchd_fabricmanager_state_info",
            1,
            active_state=active,
            sub_state=state.get("SubState", ""),
            result=state.get("Result", ""),
        )


def _systemctl(args: list[str], timeout: float) -> str:
    exe = shutil.which("systemctl")
    if exe is None:
        raise FileNotFoundError("systemctl not found")
    done = subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return done.stdout


_GPU = ("gpu", "uuid", "pci_bus_id")


def _m(name: str, kind: MetricType, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help, _GPU + labels)


FABRIC_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "gpuwatchd_gpu_fabric_state",
        "gauge",
        "NVLink fabric registration: 1 not started, 2 in progress, 3 completed "
        "(absent without a fabric).",
    ),
    _m(
        "gpuwatchd_gpu_fabric_info",
        "info",
        "Fabric registration by name, its NVML status, clique id and cluster UUID.",
        "state",
        "status",
        "clique_id",
        "cluster_uuid",
    ),
    _m(
        "gpuwatchd_gpu_fabric_health_issue",
        "gauge",
        "1 while the fabric reports this condition, 0 when it reports it absent.",
        "issue",
    ),
    MetricSpec(
        "gpuwatchd_fabricmanager_up",
        "gauge",
        "1 while the nvidia-fabricmanager unit is active (absent where it is not installed).",
    ),
    MetricSpec(
        "gpuwatchd_fabricmanager_state_info",
        "info",
        "The nvidia-fabricmanager unit's systemd state (value 1).",
        ("active_state", "sub_state", "result"),
    ),
)
