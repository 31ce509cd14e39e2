"""GPU fabric alerts: a GPU not registered with its NVLink fabric, the fabric manager down.

On HGX systems with NVSwitches a GPU joins the fabric at boot (state
"completed" in nvmlDeviceGetGpuFabricInfoV); until it has, NCCL's init hangs
or fails. The NVML source exports the state only where the GPU has a fabric,
and the fabric manager unit's state only where the unit is installed, so
these rules never fire on PCIe or single-GPU machines. health/ruleset.py
lists the rule with the others.
"""

from __future__ import annotations

from gpuwatchd.health.rules import Inputs, finding
from gpuwatchd.model import Finding

__all__ = ["fabric"]

_COMPLETED = 3  # gpuwatchd_gpu_fabric_state
_STATES = {1: "not started", 2: "in progress"}


def fabric(inp: Inputs) -> list[Finding]:
    """GPUs whose fabric registration is not complete or failed; the fabric manager down."""
    out = []
    for s in inp.view.series("gpuwatchd_gpu_fabric_state"):
        gpu = inp.view.gpu_of(s)
        if gpu is None:
            continue
        failed = [
            i.label("status")
            for i in inp.view.series("gpuwatchd_gpu_fabric_info", pci_bus_id=s.label("pci_bus_id"))
            if i.label("status") not in ("", "success")
        ]
        if s.value != _COMPLETED:
            state = _STATES.get(int(s.value), f"state {s.value:g}")
            out.append(
                finding("GpuFabricNotRegistered", gpu.subject, f"fabric state {state}", "fabric")
            )
        elif failed:
            reason = f"fabric registration failed: {failed[0]}"
            out.append(finding("GpuFabricNotRegistered", gpu.subject, reason, "fabric"))
    down = [s for s in inp.view.series("gpuwatchd_fabricmanager_up") if s.value < 1]
    if down and inp.view.series("gpuwatchd_gpu_fabric_state"):
        states = inp.view.series("gpuwatchd_fabricmanager_state_info")
        active = states[0].label("active_state") if states else "not active"
        out.append(
            finding(
                "FabricManagerDown",
                (),
                f"nvidia-fabricmanager is {active} on a node whose GPUs are on a fabric",
                "fabric",
                scope="node",
            )
        )
    return out
