"""View.series: the per-GPU index gives exactly what a scan of every sample gives."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.clock import FakeClock
from gpuwatchd.health.history import View
from gpuwatchd.model import Sample, SourceSnapshot
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource
from gpuwatchd.state import NodeSnapshot

H200X8 = Path(__file__).resolve().parent.parent / "fixtures" / "nvml" / "h200x8-from-h200x2.json"


def test_per_gpu_lookups_match_a_full_scan() -> None:
    clock = FakeClock()
    source = NvmlSource(ReplayClient.load(H200X8, clock=clock), clock=clock, call_timeout=2.0)
    try:
        samples = tuple(i for i in source.poll(clock.time()) if isinstance(i, Sample))
    finally:
        source.close()
    snap = NodeSnapshot(sources={"nvml": SourceSnapshot("nvml", samples, True, "", timestamp=1.0)})
    view = View(snap)
    assert len(view.gpus) == 8
    names = {s.name for s in samples}
    assert any(len(view.series(n)) > 8 for n in names)  # the index is used
    for name in names:
        for gpu in view.gpus.values():
            for match in ({}, {"link": "3"}, {"which": "max"}):
                want = [
                    s
                    for s in samples
                    if s.name == name
                    and s.label("uuid") == gpu.uuid
                    and s.label("gpu") == str(gpu.index)
                    and all(s.label(k) == v for k, v in match.items())
                ]
                assert view.series(name, uuid=gpu.uuid, gpu=str(gpu.index), **match) == want
                assert view.gpu_value(name, gpu, **match) == (want[0].value if want else None)
