"""NVLink series at the exposition: per-GPU roll-up by default, per link on request.

An HGX H100/H200 board has 18 NVLinks per GPU and NVML reports three error
and three corrected-error counters per link: 864 counter series and 144 speed
series per node, nearly all of them zero or constant. With `sources.nvml.nvlink_detail: gpu` (the
default) the exposition carries instead:

- `gpuwatchd_nvlink_up` per link (144 series): a link that goes down is
  named, and the "was up, now down" rules keep their history;
- `gpuwatchd_nvlink_gpu_errors_total{error}` per GPU: the sum over its links
  (40 series), continuous, for rates and dashboards;
- `gpuwatchd_nvlink_errors_total` per link only for links whose counters
  moved while the daemon watched (from then on, for the rest of its run), so
  a bad link is still named; counts a link collected before the daemon
  started stay in the GPU's sum only;
- `gpuwatchd_nvlink_gpu_corrected_errors_total{error}` per GPU in place of the
  per-link corrected counters, which move on every link under traffic.

The snapshot keeps every link: the daemon's own rules see all of them, and
`nvlink_detail: link` exports them all. No I/O; the only state is each
counter's first value.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator

from gpuwatchd.model import MetricSpec, Sample

__all__ = ["DETAILS", "NvlinkRollup", "ROLLUP_METRICS", "nvlink_rollup"]

DETAILS = ("gpu", "link")
_UP = "gpuwatchd_nvlink_up"
_SPEED = "gpuwatchd_nvlink_speed_bytes_per_second"
_ERRORS = "gpuwatchd_nvlink_errors_total"
_GPU_ERRORS = "gpuwatchd_nvlink_gpu_errors_total"
_CORRECTED = "gpuwatchd_nvlink_corrected_errors_total"
_GPU_CORRECTED = "gpuwatchd_nvlink_gpu_corrected_errors_total"

ROLLUP_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        _GPU_ERRORS,
        "counter",
        "NVLink errors summed over the GPU's links, by kind (replay, recovery, crc: what"
        " nvidia-smi nvlink -e counts). Exported with sources.nvml.nvlink_detail=gpu (default),"
        " where gpuwatchd_nvlink_errors_total carries only links with errors.",
        ("gpu", "uuid", "pci_bus_id", "error"),
    ),
    MetricSpec(
        _GPU_CORRECTED,
        "counter",
        "NVLink receive errors the links corrected, summed over the GPU's links (crc_flit,"
        " crc_data, ecc_data); not faults. Exported with sources.nvml.nvlink_detail=gpu"
        " (default) in place of gpuwatchd_nvlink_corrected_errors_total.",
        ("gpu", "uuid", "pci_bus_id", "error"),
    ),
)


class NvlinkRollup:
    """Callable exposition transform; remembers which links' counters moved."""

    def __init__(self) -> None:
        self._first: dict[tuple[str, ...], float] = {}
        self._moving: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # a scrape and the textfile writer may render at once

    def __call__(self, samples: Iterable[Sample]) -> Iterator[Sample]:
        sums: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
        corrected: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
        errors: list[Sample] = []
        for s in samples:
            if s.name == _ERRORS:
                errors.append(s)
                sums[_gpu_key(s)] += s.value
            elif s.name == _CORRECTED:
                corrected[_gpu_key(s)] += s.value
            elif s.name != _SPEED:
                yield s
        with self._lock:
            for s in errors:
                series = (*_link_key(s), s.label("error"))
                first = self._first.setdefault(series, s.value)
                if s.value != first:
                    self._moving.add(_link_key(s))
            moving = set(self._moving)
        for s in errors:
            if _link_key(s) in moving:
                yield s
        for labels, total in sums.items():
            yield Sample(_GPU_ERRORS, total, labels)
        for labels, total in corrected.items():
            yield Sample(_GPU_CORRECTED, total, labels)


def nvlink_rollup() -> NvlinkRollup:
    """A fresh roll-up transform for one exposition (see module doc)."""
    return NvlinkRollup()


def _gpu_key(s: Sample) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in s.labels if k != "link")


def _link_key(s: Sample) -> tuple[str, str]:
    return s.label("uuid") or s.label("pci_bus_id") or s.label("gpu"), s.label("link")
