"""The text-format writer against prometheus_client's, byte for byte."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector as ClientProcessCollector

from gpuwatchd.sinks.exposition import Family, Registry, format_value, render
from gpuwatchd.sinks.process import ProcessCollector

VALUES = [
    0, 1, -1, 0.1, 1e-7, 123456.0, 1234567.0, 12345678.9, 1e6, 999999.5, 1e21, -1e21,
    2**53, 1.5e300, math.inf, -math.inf, math.nan, 1700000000.123, True,
]  # fmt: skip
NASTY = ["plain", "back\\slash", "new\nline", 'quo"te', "ünï©ødé", "", '{a="b"}', "\\n"]


class _Fixed:
    def __init__(self, fams: list[object]) -> None:
        self.fams = fams

    def collect(self) -> list[object]:
        return self.fams


def _pair(seed: int) -> tuple[bytes, bytes]:
    rng = random.Random(seed)
    ours, theirs = [], []
    for i in range(rng.randint(1, 6)):
        kind = rng.choice(["counter", "gauge"])
        labels = rng.sample(["zeta", "gpu", "alpha", "uuid", "m"], rng.randint(0, 4))
        help_text = rng.choice(["Plain help.", "Back\\slash and\nnewline.", 'Quote " kept.'])
        base = f"gpuwatchd_t{seed}_{i}"
        if kind == "counter":
            fam = Family(base + "_total", kind, help_text, labels)
            ref: CounterMetricFamily | GaugeMetricFamily = CounterMetricFamily(
                base, help_text, labels=labels
            )
        else:
            fam = Family(base, kind, help_text, labels)
            ref = GaugeMetricFamily(base, help_text, labels=labels)
        for _ in range(rng.randint(0, 5)):
            values = [rng.choice(NASTY) for _ in labels]
            value = rng.choice(VALUES)
            fam.add(values, value)
            ref.add_metric(values, value)
        ours.append(fam)
        theirs.append(ref)
    reg = Registry()
    reg.register(_Fixed(ours))  # type: ignore[arg-type]
    creg = CollectorRegistry(auto_describe=False)
    creg.register(_Fixed(theirs))  # type: ignore[arg-type]
    return render(reg), generate_latest(creg)


@pytest.mark.parametrize("seed", range(40))
def test_render_matches_prometheus_client(seed: int) -> None:
    ours, theirs = _pair(seed)
    assert ours == theirs


def test_go_float_formatting() -> None:
    assert [format_value(v) for v in (1e6, 1234567.0, 100000.0, 0.5, -2.0)] == [
        "1e+06",
        "1.234567e+06",
        "100000.0",
        "0.5",
        "-2.0",
    ]
    assert (format_value(math.inf), format_value(-math.inf), format_value(math.nan)) == (
        "+Inf",
        "-Inf",
        "NaN",
    )


def test_family_rejects_wrong_label_count_and_type() -> None:
    fam = Family("gpuwatchd_x", "gauge", "X.", ("gpu",))
    with pytest.raises(ValueError):
        fam.add((), 1)
    with pytest.raises(ValueError):
        Family("gpuwatchd_x", "histogram", "X.")


def test_process_metrics_match_the_client_library() -> None:
    reg = Registry()
    reg.register(ProcessCollector())
    creg = CollectorRegistry(auto_describe=False)
    ClientProcessCollector(registry=creg)
    ours = [ln for ln in render(reg).decode().splitlines() if ln.startswith("#")]
    theirs = [ln for ln in generate_latest(creg).decode().splitlines() if ln.startswith("#")]
    assert ours == theirs and len(ours) == 12

    def values(text: bytes) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in (ln.split(" ") for ln in text.decode().splitlines() if ln[0] != "#")
        }

    mine, client = values(render(reg)), values(generate_latest(creg))
    assert mine["process_start_time_seconds"] == client["process_start_time_seconds"]
    assert mine["process_max_fds"] == client["process_max_fds"]
    assert abs(mine["process_open_fds"] - client["process_open_fds"]) <= 2
    assert (
        abs(mine["process_resident_memory_bytes"] - client["process_resident_memory_bytes"]) < 2**22
    )
    assert 0 < mine["process_cpu_seconds_total"] <= client["process_cpu_seconds_total"] + 0.1


def test_process_collector_without_proc_yields_nothing(tmp_path: object) -> None:
    reg = Registry()
    reg.register(ProcessCollector(proc=str(tmp_path)))
    assert render(reg) == b""
