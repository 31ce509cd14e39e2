"""What the rules need besides the current snapshot: a read view and a short memory.

`View` indexes one NodeSnapshot for lookups by metric name and GPU.
`History` remembers what a single snapshot cannot say: counter values
over the rate window (and when a counter last rose), which NVLinks were
ever up, which GPUs were seen, since when a
collector has been failing. The engine calls `History.observe()` before
each evaluation; the rules only read it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping

from gpuwatchd.model import Gpu, Labels, Sample, SourceSnapshot
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.state import NodeSnapshot

__all__ = ["History", "View", "gpu_key"]

SeriesKey = tuple[str, Labels]

# Counters whose rise or rate a rule looks at (prefix match).
TRACKED_COUNTERS = (
    "gpuwatchd_gpu_ecc_errors_total",
    "gpuwatchd_nvlink_errors_total",
    "gpuwatchd_gpu_pcie_replays_total",
    "gpuwatchd_infiniband_",
)
NVLINK_UP = "gpuwatchd_nvlink_up"


def gpu_key(labels: Mapping[str, str]) -> str:
    """Who a per-GPU series is about: the UUID, or `gpuN` while NVML could not say."""
    return labels.get("uuid") or (f"gpu{labels['gpu']}" if labels.get("gpu") else "")


class View:
    """Read-only lookups over one snapshot."""

    def __init__(self, snapshot: NodeSnapshot) -> None:
        self.snapshot = snapshot
        self._by_name: dict[str, list[Sample]] = defaultdict(list)
        # name -> (uuid, gpu) -> samples, built for a name at its first per-GPU lookup
        self._by_gpu: dict[str, dict[tuple[str, str], list[Sample]]] = {}
        for s in snapshot.samples():
            self._by_name[s.name].append(s)
        # GPUs are what NVML lists now; other producers (health, kmsg) label
        # series with GPUs too, but a lost GPU must not stay listed through them.
        self.gpus: dict[str, Gpu] = {}
        nvml = snapshot.sources.get("nvml")
        for s in nvml.samples if nvml is not None else ():
            key = gpu_key(dict(s.labels))
            index = s.label("gpu")
            if key and key not in self.gpus and index.isdigit():
                bus = normalize_bus_id(s.label("pci_bus_id"))
                self.gpus[key] = Gpu(index=int(index), uuid=s.label("uuid"), pci_bus_id=bus)
        self._by_bus = {g.pci_bus_id: g for g in self.gpus.values() if g.pci_bus_id}

    def source(self, name: str) -> SourceSnapshot | None:
        return self.snapshot.sources.get(name)

    def series(self, name: str, **match: str) -> list[Sample]:
        """Samples of `name` whose labels include every `match` pair."""
        pool = self._by_name.get(name, [])
        if len(pool) > 8 and "uuid" in match and "gpu" in match:  # per GPU: no scan of all GPUs
            per_gpu = self._by_gpu.get(name)
            if per_gpu is None:
                per_gpu = self._by_gpu[name] = defaultdict(list)
                for s in pool:
                    per_gpu[(s.label("uuid"), s.label("gpu"))].append(s)
            pool = per_gpu.get((match["uuid"], match["gpu"]), [])
        return [s for s in pool if all(s.label(k) == v for k, v in match.items())]

    def names(self, prefix: str) -> list[str]:
        return [n for n in self._by_name if n.startswith(prefix)]

    def gpu_of(self, sample: Sample) -> Gpu | None:
        return self.gpus.get(gpu_key(dict(sample.labels)))

    def gpu_by_bus(self, bus_id: str) -> Gpu | None:
        return self._by_bus.get(normalize_bus_id(bus_id))

    def gpu_value(self, name: str, gpu: Gpu, **match: str) -> float | None:
        for s in self.series(name, uuid=gpu.uuid, gpu=str(gpu.index), **match):
            return s.value
        return None


class History:
    """Memory across evaluations; mutated only by `observe()` (engine thread, under its lock)."""

    def __init__(self, window: float = 300.0) -> None:
        self.window = window
        self.points: dict[SeriesKey, deque[tuple[float, float]]] = {}
        self.last_rise: dict[SeriesKey, tuple[float, float, float]] = {}  # time, before, after
        self.links_up: set[tuple[str, str]] = set()  # (gpu key, link)
        self.gpus_seen: dict[str, Gpu] = {}
        self.max_gpus = 0
        self.fail_since: dict[str, float] = {}
        self.fail_since_mono: dict[str, float] = {}  # the same, in monotonic time when known
        self._seen_at: dict[str, float] = {}

    def observe(self, view: View, now: float, mono: float = 0.0) -> None:
        """Fold every source snapshot not seen before into the memory."""
        for name, snap in view.snapshot.sources.items():
            if self._seen_at.get(name) == snap.timestamp:
                continue
            self._seen_at[name] = snap.timestamp
            if snap.ok:
                self.fail_since.pop(name, None)
                self.fail_since_mono.pop(name, None)
            else:
                self.fail_since.setdefault(name, snap.timestamp or now)
                if snap.monotonic or mono:
                    self.fail_since_mono.setdefault(name, snap.monotonic or mono)
            self._observe_samples(snap.samples, snap.timestamp or now)
            if name == "nvml" and snap.ok:
                self.gpus_seen.update(view.gpus)
                self.max_gpus = max(self.max_gpus, len(view.gpus))
        for group in view.snapshot.extra.values():
            self._observe_samples(group, now)

    def _observe_samples(self, samples: Iterable[Sample], t: float) -> None:
        for s in samples:
            if s.name == NVLINK_UP and s.value >= 1:
                self.links_up.add((gpu_key(dict(s.labels)), s.label("link")))
            elif s.name.startswith(TRACKED_COUNTERS) and s.name.endswith("_total"):
                self._add_point((s.name, s.labels), t, s.value)

    def _add_point(self, key: SeriesKey, t: float, value: float) -> None:
        pts = self.points.get(key)
        if pts is None:
            pts = self.points[key] = deque()
        elif pts and t <= pts[-1][0]:
            return
        if pts:
            before = pts[-1][1]
            if value > before:
                self.last_rise[key] = (t, before, value)
            elif value < before and value > 0:  # reset, then new errors
                self.last_rise[key] = (t, 0.0, value)
        pts.append((t, value))
        # Keep one point older than the window as the baseline of the increase.
        while len(pts) > 2 and pts[1][0] < t - self.window:
            pts.popleft()

    def increase(self, name: str, labels: Labels, now: float) -> float:
        """Counter increase over the window ending at `now`, counting resets as restarts."""
        pts = self.points.get((name, labels))
        if not pts:
            return 0.0
        total = 0.0
        prev: tuple[float, float] | None = None
        for t, v in pts:
            if prev is not None and t >= now - self.window:
                total += v - prev[1] if v >= prev[1] else v
            prev = (t, v)
        return total

    def rate(self, name: str, labels: Labels, now: float) -> float:
        """Average per-second increase over the window (increase / window)."""
        return self.increase(name, labels, now) / self.window

    def rose_within(
        self, name: str, labels: Labels, now: float, hold: float
    ) -> tuple[float, float, float] | None:
        """(time, before, after) of the counter's last rise if it was within `hold`."""
        rise = self.last_rise.get((name, labels))
        if rise is not None and now - rise[0] <= hold:
            return rise
        return None

    def failing_for(self, source: str, now: float, mono: float = 0.0) -> float:
        """Seconds `source` has failed: from monotonic times when `mono` is given."""
        since_mono = self.fail_since_mono.get(source)
        if mono and since_mono is not None:
            return mono - since_mono
        since = self.fail_since.get(source)
        return 0.0 if since is None else now - since

    def restore(self, max_gpus: int, links_up: Mapping[str, Iterable[str]] | None = None) -> None:
        """Seed memory kept outside the process (the GPU count baseline)."""
        self.max_gpus = max(self.max_gpus, max_gpus)
        for uuid, links in (links_up or {}).items():
            self.links_up.update((uuid, link) for link in links)
