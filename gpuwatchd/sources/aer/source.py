"""PCIe Advanced Error Reporting counters of the GPUs, nearby NICs and the bridges above them.

Reads the kernel's AER statistics in sysfs (see sources/aer/sysfs.py for the
format) for every NVIDIA GPU, every RDMA device, every Ethernet function on
a GPU's root complex, and each bridge between them and the root port. The
kernel counts an error at the function that saw it, which may be the link
partner (the switch port or root port above) rather than the function at
fault: that is why the bridges are read too. Counters are exported as the
kernel shows them; they restart at 0 when a function is removed and
re-enumerated, which Prometheus and the health rules take as a reset.

A node whose functions have no aer_dev_* files (most VMs, kernels without
CONFIG_PCIEAER, `pci=noaer`) exports `gpuwatchd_pcie_aer_available 0`, says
why once in the log and in /status, and the poll succeeds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpuwatchd.errors import SourceError
from gpuwatchd.model import Event, GpuInventory, MetricSpec, Sample
from gpuwatchd.sources.aer.sysfs import (
    DEV_FILES,
    ROOTPORT_FILES,
    AerDevice,
    DevCounts,
    discover,
    parse_dev_file,
    parse_total,
)

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = ["AerSource", "METRICS", "UNAVAILABLE_NO_DEVICES", "UNAVAILABLE_NO_FILES"]

log = logging.getLogger("gpuwatchd.aer")

P = "gpuwatchd_pcie_aer_"
DEVICE_LABELS = ("pci_bus_id", "role", "severity")
UNAVAILABLE_NO_DEVICES = "no GPU or NIC PCI function found under paths.sysfs"
UNAVAILABLE_NO_FILES = (
    "no aer_dev_* files on any watched PCI function: AER is not exposed here "
    "(a VM's emulated bus, a kernel without CONFIG_PCIEAER, or pci=noaer)"
)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        P + "available",
        "gauge",
        "1 when some watched PCI function exposes AER counters in sysfs; 0 when none does "
        "(see /status for why).",
    ),
    MetricSpec(
        P + "device_info",
        "info",
        "A watched PCI function: role gpu, nic, bridge or root_port, its root port, and the "
        "GPUs (index) and NICs at or below it; always 1.",
        ("pci_bus_id", "role", "root_port", "gpus", "nics"),
    ),
    MetricSpec(
        P + "errors_total",
        "counter",
        "ERR_COR / ERR_NONFATAL / ERR_FATAL messages the function sent (the kernel's "
        "TOTAL_ERR_* line of aer_dev_correctable, _nonfatal, _fatal).",
        DEVICE_LABELS,
    ),
    MetricSpec(
        P + "error_types_total",
        "counter",
        "Errors by type as the kernel names the AER status bit (RxErr, BadTLP, SDES, "
        "CmpltTO...); only types that have counted at least one.",
        (*DEVICE_LABELS, "error"),
    ),
    MetricSpec(
        P + "rootport_errors_total",
        "counter",
        "ERR_* messages that reached a root port from any function of its hierarchy "
        "(aer_rootport_total_err_cor, _nonfatal, _fatal).",
        ("pci_bus_id", "severity"),
    ),
    MetricSpec(
        P + "read_errors_total",
        "counter",
        "AER sysfs files that could not be read or parsed, by reason.",
        ("reason",),
    ),
)


class AerSource:
    """AER counters of the node's GPUs, nearby NICs and their bridges, from paths.sysfs."""

    name = "aer"

    def __init__(
        self,
        sysfs: str,
        interval: float = 30.0,
        gpus: Callable[[], GpuInventory] | None = None,
    ) -> None:
        self.interval = interval
        self._sysfs = sysfs
        self._gpus: Callable[[], GpuInventory] = gpus or GpuInventory
        self._devices: list[AerDevice] = []
        self._layout: tuple[object, ...] | None = None
        self._seen_types: set[tuple[str, str, str]] = set()  # (bus, severity, error) ever > 0
        self._errors: dict[str, int] = {}
        self._said: str | None = None  # the unavailability reason last logged
        self._status: dict[str, object] = {"available": False}

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> AerSource:
        """Build from sources.aer and paths.sysfs; GPU indices come from ctx.gpus."""
        return cls(cfg.paths.sysfs, interval=cfg.sources.aer.interval, gpus=ctx.gpus)

    def poll(self, now: float) -> Sequence[Sample | Event]:
        self._rediscover()
        out: list[Sample | Event] = []
        status: dict[str, object] = {}
        with_files = 0
        for dev in self._devices:
            got = self._read_device(dev)
            if got is None:
                continue
            with_files += 1
            status[dev.bus_id] = {"role": dev.role, **{s: c.total for s, c in got.items()}}
            out.append(self._info(dev))
            out.extend(self._device_samples(dev, got))
            if dev.role == "root_port":
                out.extend(self._rootport_samples(dev))
        reason = ""
        if not self._devices:
            reason = UNAVAILABLE_NO_DEVICES
        elif not with_files:
            reason = UNAVAILABLE_NO_FILES
        self._say(reason)
        out.append(Sample.of(P + "available", 0 if reason else 1))
        out.extend(
            Sample.of(P + "read_errors_total", n, reason=r) for r, n in sorted(self._errors.items())
        )
        self._status = {
            "available": not reason,
            **({"reason": reason} if reason else {}),
            "devices_watched": len(self._devices),
            "devices_with_aer": with_files,
            "devices": status,
        }
        return out

    def status(self) -> Mapping[str, object]:
        return self._status

    def close(self) -> None:
        pass

    # --- parts of a poll -----------------------------------------------------------

    def _rediscover(self) -> None:
        """Walk the PCI tree again only when the GPUs or the device listings changed."""
        known = {g.pci_bus_id: str(g.index) for g in self._gpus() if g.pci_bus_id}
        bus_dir = os.path.join(self._sysfs, "bus", "pci", "devices")
        try:
            buses = tuple(sorted(os.listdir(bus_dir)))
        except FileNotFoundError:
            buses = ()
        except OSError as exc:
            raise SourceError("sysfs_unreadable", f"{bus_dir}: {exc.strerror}") from None
        layout = (
            tuple(sorted(known.items())),
            buses,
            *(self._names("class", c) for c in ("infiniband", "net")),
        )
        if layout != self._layout:
            self._devices = discover(self._sysfs, known) if buses else []
            self._layout = layout
            present = {d.bus_id for d in self._devices}
            self._seen_types = {k for k in self._seen_types if k[0] in present}

    def _names(self, *parts: str) -> tuple[str, ...]:
        try:
            return tuple(sorted(os.listdir(os.path.join(self._sysfs, *parts))))
        except OSError:
            return ()

    def _read_device(self, dev: AerDevice) -> dict[str, DevCounts] | None:
        """The three aer_dev_* files of a function; None when it has none."""
        got: dict[str, DevCounts] = {}
        for severity, fname in DEV_FILES.items():
            text = self._read(os.path.join(dev.path, fname))
            if text is None:
                continue
            counts = parse_dev_file(text)
            if counts is None:
                self._count("unparsable")
            else:
                got[severity] = counts
        return got or None

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError:
            self._count("unreadable")
            return None

    def _info(self, dev: AerDevice) -> Sample:
        return Sample.of(
            P + "device_info",
            1,
            pci_bus_id=dev.bus_id,
            role=dev.role,
            root_port=dev.root_port,
            gpus=",".join(dev.gpus),
            nics=",".join(dev.nics),
        )

    def _device_samples(self, dev: AerDevice, got: Mapping[str, DevCounts]) -> list[Sample]:
        out = []
        for severity, counts in got.items():
            labels = {"pci_bus_id": dev.bus_id, "role": dev.role, "severity": severity}
            out.append(Sample.of(P + "errors_total", counts.total, **labels))
            for error, n in counts.by_error.items():
                key = (dev.bus_id, severity, error)
                if n > 0:
                    self._seen_types.add(key)
                if key in self._seen_types:
                    out.append(Sample.of(P + "error_types_total", n, **labels, error=error))
        return out

    def _rootport_samples(self, dev: AerDevice) -> list[Sample]:
        out = []
        for severity, fname in ROOTPORT_FILES.items():
            text = self._read(os.path.join(dev.path, fname))
            if text is None:
                continue
            value = parse_total(text)
            if value is None:
                self._count("unparsable")
                continue
            out.append(
                Sample.of(
                    P + "rootport_errors_total", value, pci_bus_id=dev.bus_id, severity=severity
                )
            )
        return out

    def _say(self, reason: str) -> None:
        """Log a change of availability once, never on every poll."""
        if reason == (self._said or ""):
            return
        if reason:
            log.info(
                "PCIe AER counters unavailable: %s; exporting gpuwatchd_pcie_aer_available 0",
                reason,
            )
        elif self._said is not None:
            log.info("PCIe AER counters available again")
        self._said = reason

    def _count(self, reason: str) -> None:
        self._errors[reason] = self._errors.get(reason, 0) + 1
