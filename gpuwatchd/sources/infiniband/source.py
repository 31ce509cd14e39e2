"""InfiniBand and RoCE ports from sysfs: state, rate, counters, and which GPUs each NIC serves.

Reads /sys/class/infiniband/<device>/ports/<n>/ (kernel ABI:
Documentation/ABI/stable/sysfs-class-infiniband). Metric names follow
node_exporter's infiniband collector with the `gpuwatchd_` prefix, so
queries port over. Facts worth knowing:

- port_rcv_data and port_xmit_data count 4-byte words; they are exported
  as bytes (x4), as node_exporter does.
- A counter the driver cannot read shows `N/A (no PMA)`; it is left out,
  never exported as 0.
- Counters are exported as the kernel shows them. Prometheus treats a
  decrease as a reset; the source also counts resets per port (a PMA
  reset with `perfquery -R`, a driver reload) so the rules can tell a
  reset from a quiet port. Old 32-bit PMA counters saturate rather than
  wrap; a saturated counter just stops moving.
- state_id: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER;
  physical_state_id: 1 Sleep, 2 Polling, 3 Disabled,
  4 PortConfigurationTraining, 5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test.

No /sys/class/infiniband means no InfiniBand: the source exports nothing,
logs that once, and the poll succeeds.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpuwatchd.errors import ConfigError, SourceError
from gpuwatchd.model import Event, GpuInventory, MetricSpec, MetricType, Sample
from gpuwatchd.pci import gpu_affinity
from gpuwatchd.ports import STATE_ACTIVE
from gpuwatchd.sources.infiniband.sysfs import (
    COUNTERS,
    HW_NOT_COUNTERS,
    Port,
    key_of,
    read_port,
    read_text,
)

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.sources.context import SourceContext

__all__ = [
    "InfinibandSource",
    "METRICS",
]

log = logging.getLogger("gpuwatchd.infiniband")


PORT_LABELS = ("device", "port")


def _spec(
    name: str, type_: MetricType, help_: str, labels: tuple[str, ...] = PORT_LABELS
) -> MetricSpec:
    return MetricSpec(f"gpuwatchd_infiniband_{name}", type_, help_, labels)


METRICS: tuple[MetricSpec, ...] = (
    _spec(
        "info",
        "info",
        "Non-numeric data of an InfiniBand/RDMA device; always 1.",
        ("device", "board_id", "firmware_version", "hca_type"),
    ),
    _spec(
        "port_info",
        "info",
        "Port link layer (InfiniBand or Ethernet for RoCE) and state names; always 1.",
        ("device", "port", "link_layer", "state", "physical_state"),
    ),
    _spec(
        "state_id",
        "gauge",
        "Port state (0: no change, 1: down, 2: init, 3: armed, 4: active, 5: active defer).",
    ),
    _spec(
        "physical_state_id",
        "gauge",
        "Physical port state (1: sleep, 2: polling, 3: disabled, "
        "4: port configuration training, 5: link up, 6: link error recovery, 7: phy test).",
    ),
    _spec("rate_bytes_per_second", "gauge", "Current signalling rate of the port."),
    _spec(
        "expected_rate_bytes_per_second",
        "gauge",
        "Rate the port should run at: sources.infiniband.expected_rate_gbps, else the "
        "highest rate seen on it since the daemon started.",
    ),
    _spec(
        "port_expected_up",
        "gauge",
        "1 if the port must be ACTIVE: it was ACTIVE since the daemon started or "
        "sources.infiniband.expected_up names it.",
    ),
    *(_spec(metric, "counter", help_) for metric, help_, _ in COUNTERS.values()),
    _spec(
        "hw_counters_total",
        "counter",
        "Driver-specific hw_counters/ of the port (RoCE retransmits, CNPs, out_of_buffer...).",
        ("device", "port", "counter"),
    ),
    _spec(
        "port_stats_resets_total",
        "counter",
        "Polls in which a port counter went down (counters reset or the device reappeared).",
    ),
    _spec(
        "gpu_affinity_info",
        "info",
        "GPUs close to the device: affinity pcie_switch (a shared PCIe switch), "
        "host_bridge (same root complex) or numa_node; always 1.",
        ("device", "gpu", "affinity"),
    ),
    _spec(
        "read_errors_total",
        "counter",
        "sysfs files of InfiniBand ports that could not be read or parsed, by reason.",
        ("reason",),
    ),
)


class InfinibandSource:
    """Ports of every RDMA device under <sysfs>/class/infiniband."""

    name = "infiniband"

    def __init__(
        self,
        sysfs: str,
        interval: float = 15.0,
        include: str = "",
        exclude: str = "",
        hw_counters: bool = True,
        expected_rate_gbps: Mapping[str, float] | None = None,
        expected_up: str = "",
        gpus: Callable[[], GpuInventory] | None = None,
    ) -> None:
        self.interval = interval
        self._sysfs = sysfs
        self._class_dir = os.path.join(sysfs, "class", "infiniband")
        self._include = _regex("device_include", include)
        self._exclude = _regex("device_exclude", exclude)
        self._expected_up = _regex("expected_up", expected_up)
        self._hw = hw_counters
        self._expected_rate = {k: v * 1e9 / 8 for k, v in (expected_rate_gbps or {}).items()}
        self._gpus: Callable[[], GpuInventory] = gpus or GpuInventory
        self._said_absent = False
        self._prev: dict[str, dict[str, int]] = {}  # port key -> counter file -> value
        self._resets: dict[str, int] = {}
        self._max_rate: dict[str, float] = {}
        self._was_active: set[str] = set()
        self._errors: dict[str, int] = {}
        self._affinity: dict[str, dict[str, list[str]]] = {}
        self._affinity_key: tuple[str, ...] | None = None
        self._status: dict[str, object] = {"present": False}

    @classmethod
    def from_config(cls, cfg: Config, ctx: SourceContext) -> InfinibandSource:
        """Build from sources.infiniband and paths.sysfs; GPUs come from ctx.gpus."""
        c = cfg.sources.infiniband
        return cls(
            cfg.paths.sysfs,
            interval=c.interval,
            include=c.device_include,
            exclude=c.device_exclude,
            hw_counters=c.hw_counters,
            expected_rate_gbps=c.expected_rate_gbps,
            expected_up=c.expected_up,
            gpus=ctx.gpus,
        )

    def poll(self, now: float) -> Sequence[Sample | Event]:
        devices = self._devices()
        if not devices:
            self._status = {"present": False, "path": self._class_dir}
            return [self._error_sample(r, n) for r, n in self._errors.items()]
        out: list[Sample | Event] = []
        ports_status: dict[str, object] = {}
        seen: set[str] = set()
        for dev in devices:
            dev_dir = os.path.join(self._class_dir, dev)
            out.append(self._info(dev, dev_dir))
            try:
                port_names = sorted(os.listdir(os.path.join(dev_dir, "ports")), key=_num_key)
            except OSError:
                self._count("unreadable")
                continue
            for pname in port_names:
                port = read_port(os.path.join(dev_dir, "ports", pname), dev, pname, self._hw)
                for reason in port.problems:
                    self._count(reason)
                key = key_of(dev, pname)
                seen.add(key)
                out.extend(self._port_samples(port, key))
                ports_status[key] = {
                    "state": port.state,
                    "physical_state": port.phys_state,
                    "link_layer": port.link_layer,
                    "rate_gbps": None if port.rate is None else port.rate * 8 / 1e9,
                }
        for gone in set(self._prev) - seen:
            del self._prev[gone]  # a device that returns starts afresh (counted as a reset)
        out.extend(self._affinity_samples(devices))
        out.extend(self._error_sample(r, n) for r, n in self._errors.items())
        self._status = {
            "present": True,
            "devices": devices,
            "ports": ports_status,
            "gpu_affinity": self._affinity,
        }
        return out

    def status(self) -> Mapping[str, object]:
        return self._status

    def close(self) -> None:
        pass

    # --- parts of a poll -----------------------------------------------------------

    def _devices(self) -> list[str]:
        try:
            names = sorted(os.listdir(self._class_dir))
        except FileNotFoundError:
            if not self._said_absent:
                log.info("no InfiniBand/RDMA devices (%s absent); exporting none", self._class_dir)
                self._said_absent = True
            return []
        except OSError as exc:
            raise SourceError("sysfs_unreadable", f"{self._class_dir}: {exc.strerror}") from None
        kept = [
            n
            for n in names
            if (not self._include or self._include.search(n))
            and not (self._exclude and self._exclude.search(n))
        ]
        if not kept and not self._said_absent:
            log.info("no InfiniBand/RDMA devices to watch in %s; exporting none", self._class_dir)
            self._said_absent = True
        return kept

    def _info(self, dev: str, dev_dir: str) -> Sample:
        def attr(name: str) -> str:
            return (read_text(os.path.join(dev_dir, name)) or "").strip()

        return Sample.of(
            "gpuwatchd_infiniband_info",
            1,
            device=dev,
            board_id=attr("board_id"),
            firmware_version=attr("fw_ver"),
            hca_type=attr("hca_type"),
        )

    def _port_samples(self, port: Port, key: str) -> list[Sample]:
        labels = {"device": port.device, "port": port.port}
        out = [
            Sample.of(
                "gpuwatchd_infiniband_port_info",
                1,
                **labels,
                link_layer=port.link_layer,
                state=port.state,
                physical_state=port.phys_state,
            )
        ]
        if port.state_id is not None:
            out.append(Sample.of("gpuwatchd_infiniband_state_id", port.state_id, **labels))
            if port.state_id == STATE_ACTIVE:
                self._was_active.add(key)
        if port.phys_state_id is not None:
            out.append(
                Sample.of("gpuwatchd_infiniband_physical_state_id", port.phys_state_id, **labels)
            )
        if port.rate is not None:
            out.append(Sample.of("gpuwatchd_infiniband_rate_bytes_per_second", port.rate, **labels))
            if port.state_id == STATE_ACTIVE:
                self._max_rate[key] = max(self._max_rate.get(key, 0.0), port.rate)
        expected = self._expected_rate.get(key, self._expected_rate.get(port.device))
        if expected is None:
            expected = self._max_rate.get(key)
        if expected is not None:
            out.append(
                Sample.of("gpuwatchd_infiniband_expected_rate_bytes_per_second", expected, **labels)
            )
        must_be_up = key in self._was_active or bool(
            self._expected_up and self._expected_up.search(key)
        )
        out.append(Sample.of("gpuwatchd_infiniband_port_expected_up", int(must_be_up), **labels))
        for fname, value in port.counters.items():
            spec = COUNTERS.get(fname)
            if spec is not None:
                out.append(Sample.of(f"gpuwatchd_infiniband_{spec[0]}", value * spec[2], **labels))
        hw_name = "gpuwatchd_infiniband_hw_counters_total"
        for cname, value in port.hw_counters.items():
            if cname not in HW_NOT_COUNTERS:
                out.append(Sample.of(hw_name, value, **labels, counter=cname))
        hw = {"hw:" + k: v for k, v in port.hw_counters.items()}
        self._track_resets(key, {**port.counters, **hw})
        resets = self._resets.get(key, 0)
        out.append(Sample.of("gpuwatchd_infiniband_port_stats_resets_total", resets, **labels))
        return out

    def _track_resets(self, key: str, values: dict[str, int]) -> None:
        prev = self._prev.get(key)
        if prev is not None and any(v < prev.get(k, 0) for k, v in values.items()):
            self._resets[key] = self._resets.get(key, 0) + 1
            log.info("counters of %s went down: reset or device re-added", key)
        self._prev[key] = values

    def _affinity_samples(self, devices: Sequence[str]) -> list[Sample]:
        gpus = {g.pci_bus_id: str(g.index) for g in self._gpus() if g.pci_bus_id}
        cache_key = (*sorted(devices), "|", *sorted(f"{b}={g}" for b, g in gpus.items()))
        if cache_key != self._affinity_key:
            self._affinity = {
                dev: gpu_affinity(self._sysfs, os.path.join(self._class_dir, dev, "device"), gpus)
                for dev in devices
            }
            self._affinity_key = cache_key
        name = "gpuwatchd_infiniband_gpu_affinity_info"
        return [
            Sample.of(name, 1, device=dev, gpu=gpu, affinity=kind)
            for dev, kinds in self._affinity.items()
            for kind, gpu_list in kinds.items()
            for gpu in gpu_list
        ]

    def _error_sample(self, reason: str, count: int) -> Sample:
        return Sample.of("gpuwatchd_infiniband_read_errors_total", count, reason=reason)

    def _count(self, reason: str) -> None:
        self._errors[reason] = self._errors.get(reason, 0) + 1


def _num_key(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _regex(key: str, pattern: str) -> re.Pattern[str] | None:
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigError("", f"sources.infiniband.{key}", f"bad regex: {exc}") from None
