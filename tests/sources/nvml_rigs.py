"""A NvmlSource polling a replay of a real capture, for the tests/sources/test_nvml*.py files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuwatchd.clock import FakeClock
from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvml"
H200X2 = FIXTURES / "h200x2-probe.json"
H200X8 = FIXTURES / "h200x8-from-h200x2.json"


class Rig:
    """A source polling a replay, closed (and any hung replay call released) at the end."""

    def __init__(
        self, path: Path = H200X2, script: Sequence[dict[str, Any]] = (), **kwargs: Any
    ) -> None:
        self.clock = kwargs.pop("clock", FakeClock())
        self.client = ReplayClient.load(path, script=script, clock=self.clock)
        kwargs.setdefault("call_timeout", 2.0)
        self.source = NvmlSource(self.client, clock=self.clock, **kwargs)

    def poll(self) -> list[Sample]:
        items = self.source.poll(self.clock.time())
        assert all(isinstance(i, Sample) for i in items)
        return [i for i in items if isinstance(i, Sample)]

    def close(self) -> None:
        self.client.release()
        self.source.close()


def rig(rigs: list[Rig], *args: Any, **kwargs: Any) -> Rig:
    r = Rig(*args, **kwargs)
    rigs.append(r)
    return r


def find(samples: Sequence[Sample], name: str, **labels: str) -> list[Sample]:
    return [
        s for s in samples if s.name == name and all(s.label(k) == v for k, v in labels.items())
    ]


def value(samples: Sequence[Sample], name: str, **labels: str) -> float:
    found = find(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0].value
