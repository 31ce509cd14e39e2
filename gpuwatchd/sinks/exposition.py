"""The Prometheus text format (version 0.0.4), written without a client library.

The daemon needs only gauges and counters rendered from its own snapshot, so
it writes the format itself instead of importing prometheus_client, whose
import (with the stdlib HTTP and email packages it pulls in) was the largest
part of the daemon's memory above a bare NVML process. The output is byte for
byte what prometheus_client's `generate_latest` writes for the same families
(label names sorted, Go float formatting); tests compare the two.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

__all__ = [
    "CONTENT_TYPE",
    "Collector",
    "Family",
    "Registry",
    "format_value",
    "render",
    "write_textfile",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Family:
    """One metric family: name, type, help and its samples, in insertion order.

    A counter's `name` is the exposed name, `_total` included.
    """

    __slots__ = ("help", "labels", "name", "samples", "type", "_order")

    def __init__(self, name: str, kind: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if kind not in ("counter", "gauge"):
            raise ValueError(f"{name}: unsupported metric type {kind!r}")
        self.name = name
        self.type = kind
        self.help = help_text
        self.labels = tuple(labels)
        # The format lists label pairs sorted by name, whatever the declared order.
        self._order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        self.samples: list[tuple[tuple[str, ...], float]] = []

    def add(self, values: Sequence[str], value: float) -> None:
        """Add one series; `values` follow `labels` in order."""
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(values)} label values for {self.labels}")
        self.samples.append((tuple(str(v) for v in values), value))

    def lines(self) -> Iterator[str]:
        """The family's HELP, TYPE and sample lines, each ending in a newline."""
        help_text = self.help.replace("\\", r"\\").replace("\n", r"\n")
        yield f"# HELP {self.name} {help_text}\n"
        yield f"# TYPE {self.name} {self.type}\n"
        names = [self.labels[i] for i in self._order]
        for values, value in self.samples:
            if names:
                pairs = ",".join(
                    f'{k}="{_escape(values[i])}"' for k, i in zip(names, self._order, strict=True)
                )
                yield f"{self.name}{{{pairs}}} {format_value(value)}\n"
            else:
                yield f"{self.name} {format_value(value)}\n"


class Collector(Protocol):
    """Anything that yields families when rendered."""

    def collect(self) -> Iterable[Family]: ...


class Registry:
    """Collectors rendered in registration order."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        """Add a collector (once)."""
        if collector not in self._collectors:
            self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        """Remove a collector; unknown ones are ignored."""
        if collector in self._collectors:
            self._collectors.remove(collector)

    def collect(self) -> Iterator[Family]:
        """Every family of every collector."""
        for collector in list(self._collectors):
            yield from collector.collect()


def render(registry: Registry) -> bytes:
    """The exposition of every family in `registry`, UTF-8."""
    return "".join(line for fam in registry.collect() for line in fam.lines()).encode()


def format_value(value: float) -> str:
    """A sample value as Go's strconv writes it: +Inf, -Inf, NaN, 1e+06 past six digits."""
    d = float(value)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    text = repr(d)
    dot = text.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def write_textfile(registry: Registry, path: str) -> None:
    """Write the exposition atomically (tmp file + rename) for node_exporter's textfile."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gpuwatchd-", suffix=".prom.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(render(registry))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
