"""Prometheus exposition built fresh from the latest snapshot on every scrape.

A custom prometheus_client collector: `collect()` yields Gauge/Counter
metric families, and prometheus_client writes them in whichever format the
scrape negotiates. The collector never calls a source: it reads
`State.snapshot()`, one reference, so a hung NVML call cannot slow a scrape. Families come from
the MetricSpec tables each producer declares. A sample that has no spec,
whose labels differ from its spec's, or that repeats a series is left out,
logged once per name and counted in gpuwatchd_exporter_dropped_samples_total;
in strict mode (the test suite: GPUWATCHD_STRICT_EXPORT=1) it raises instead.
"""

from __future__ import annotations

import logging
import os
import platform
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from gpuwatchd import __version__
from gpuwatchd.model import MetricSpec, Sample
from gpuwatchd.state import NodeSnapshot, State

__all__ = [
    "DAEMON_METRICS",
    "DROP_REASONS",
    "DroppedSampleError",
    "STRICT_ENV",
    "SnapshotCollector",
    "family",
    "write_textfile",
]

log = logging.getLogger("gpuwatchd.prometheus")

_CACHED = " Collected on the source's own timer and served from cache."

# Set to 1 (the test suite does) to make a sample the exposition would drop an error.
STRICT_ENV = "GPUWATCHD_STRICT_EXPORT"
DROP_REASONS = ("duplicate_series", "label_mismatch", "no_spec")

DAEMON_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuwatchd_collector_success",
        "gauge",
        "1 if the collector's last poll succeeded, else 0." + _CACHED,
        ("collector",),
    ),
    MetricSpec(
        "gpuwatchd_collector_duration_seconds",
        "gauge",
        "How long the collector's last poll took." + _CACHED,
        ("collector",),
    ),
    MetricSpec(
        "gpuwatchd_collector_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the collector's last successful poll." + _CACHED,
        ("collector",),
    ),
    MetricSpec(
        "gpuwatchd_collector_errors_total",
        "counter",
        "Polls of the collector that failed, by reason.",
        ("collector", "reason"),
    ),
    MetricSpec(
        "gpuwatchd_build_info",
        "gauge",
        "Build information; always 1.",
        ("version", "python_version"),
    ),
    MetricSpec(
        "gpuwatchd_exporter_dropped_samples_total",
        "counter",
        "Samples left out of the exposition, counted once per snapshot: no_spec (no "
        "MetricSpec declares the name), label_mismatch (label names differ from the "
        "spec's), duplicate_series (a second sample for the same series). Any increase "
        "is a bug in gpuwatchd.",
        ("reason",),
    ),
)


class DroppedSampleError(RuntimeError):
    """A sample the exposition cannot carry, raised in strict mode."""


class SnapshotCollector:
    """Yields metric families from the current snapshot; never blocks."""

    def __init__(
        self,
        state: State,
        specs: Iterable[MetricSpec],
        strict: bool | None = None,
        transform: Callable[[Iterable[Sample]], Iterable[Sample]] | None = None,
    ) -> None:
        self._state = state
        # Exposition-only reshaping (the NVLink roll-up); the snapshot keeps every sample.
        self._transform = transform
        self._specs = {s.name: s for s in (*DAEMON_METRICS, *specs)}
        self._strict = os.environ.get(STRICT_ENV) == "1" if strict is None else strict
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._logged: set[tuple[str, str]] = set()
        self._counted_generation = -1

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on the snapshot (no collect at register)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The snapshot's families, then the drop counter."""
        snap = self._state.snapshot()
        # Renders of one snapshot (scrape, textfile) count its drops once.
        counting = snap.generation != self._counted_generation
        self._counted_generation = snap.generation
        grouped: dict[str, list[Sample]] = defaultdict(list)
        for sample in _self_samples(snap):
            grouped[sample.name].append(sample)
        samples = snap.samples()
        for sample in self._transform(samples) if self._transform else samples:
            grouped[sample.name].append(sample)
        families: list[Metric] = []
        for name, samples in grouped.items():
            spec = self._specs.get(name)
            if spec is None:
                self._drop("no_spec", samples[0], len(samples), counting)
                continue
            fam = family(spec)
            seen: set[tuple[str, ...]] = set()
            for s in samples:
                values = _label_values(spec, s)
                if values is None:
                    self._drop("label_mismatch", s, 1, counting)
                elif values in seen:
                    self._drop("duplicate_series", s, 1, counting)
                else:
                    seen.add(values)
                    fam.add_metric(values, s.value)
            families.append(fam)
        dropped = family(self._specs["gpuwatchd_exporter_dropped_samples_total"])
        for reason in DROP_REASONS:
            dropped.add_metric((reason,), self._dropped[reason])
        families.append(dropped)
        yield from families

    def _drop(self, reason: str, sample: Sample, n: int, counting: bool) -> None:
        """Leave a sample out: count it, say so once per name and reason; raise if strict."""
        what = f"sample {sample.name}{dict(sample.labels)} dropped from the exposition: {reason}"
        if self._strict:
            raise DroppedSampleError(what)
        if counting:
            self._dropped[reason] += n
        if (sample.name, reason) not in self._logged:
            self._logged.add((sample.name, reason))
            log.error("%s (logged once per name)", what)


def family(spec: MetricSpec) -> GaugeMetricFamily | CounterMetricFamily:
    """An empty family for `spec`; a counter is exposed as `<name>_total` whatever the spec says."""
    if spec.type == "counter":
        return CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


def _label_values(spec: MetricSpec, sample: Sample) -> tuple[str, ...] | None:
    have = dict(sample.labels)
    if set(have) != set(spec.labels):
        return None
    return tuple(str(have[k]) for k in spec.labels)


def _self_samples(snap: NodeSnapshot) -> Iterator[Sample]:
    yield Sample.of(
        "gpuwatchd_build_info", 1, version=__version__, python_version=platform.python_version()
    )
    for name, src in snap.sources.items():
        yield Sample.of("gpuwatchd_collector_success", 1 if src.ok else 0, collector=name)
        yield Sample.of(
            "gpuwatchd_collector_duration_seconds", src.duration_seconds, collector=name
        )
        if src.last_success:
            yield Sample.of(
                "gpuwatchd_collector_last_success_timestamp_seconds",
                src.last_success,
                collector=name,
            )
        for reason, count in src.errors_by_reason.items():
            yield Sample.of(
                "gpuwatchd_collector_errors_total", count, collector=name, reason=reason
            )


def write_textfile(registry: Collector, path: str) -> None:
    """Write the text exposition atomically (tmp file + rename) for node_exporter's textfile.

    Not prometheus_client's write_to_textfile: that one leaves the file to the
    daemon's umask (0077), and node_exporter runs as another user.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gpuwatchd-", suffix=".prom.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(generate_latest(registry))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
