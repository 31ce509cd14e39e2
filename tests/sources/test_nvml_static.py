"""Static NVML readings (application clocks, ECC and MIG mode) on a slow cadence.

Replays of the real H100 idle capture: the cached calls reach NVML once per
`static_interval`, the exposition is the same as when every poll asks, and
anything that can change them makes the next poll ask again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config import load_text
from gpuwatchd.errors import ConfigError
from gpuwatchd.model import Event, Sample
from tests.sources.nvml_rigs import FIXTURES as NVML
from tests.sources.nvml_rigs import Rig

H100 = NVML / "h100-idle-record.json"
STATIC = ("applications_clock(0)", "applications_clock(2)", "ecc_mode", "mig_mode")


class StaticRig(Rig):
    """The NVML source over the H100 idle replay, static reads every 300 s, 10 s a poll."""

    def __init__(
        self, script: Sequence[dict[str, Any]] = (), capture: Path = H100, **kwargs: Any
    ) -> None:
        kwargs.setdefault("static_interval", 300.0)
        super().__init__(capture, script=script, **kwargs)

    def poll(self, advance: float = 10.0) -> list[Sample]:
        """The samples of the next poll (an Xid event it brings is not asserted away)."""
        self.clock.advance(advance)
        return [i for i in self.source.poll(self.clock.time()) if isinstance(i, Sample)]

    def asked(self) -> dict[str, int]:
        """How often each static call reached the replay."""
        return {key: self.client.count(0, key) for key in STATIC}


def rig(rigs: list[Rig], *args: Any, **kwargs: Any) -> StaticRig:
    r = StaticRig(*args, **kwargs)
    rigs.append(r)
    return r


def comparable(samples: Sequence[Sample]) -> set[Sample]:
    return {s for s in samples if s.name != "gpuwatchd_gpu_poll_duration_seconds"}


def test_static_calls_are_read_once_per_interval_and_reported_every_poll(
    rigs: list[Rig],
) -> None:
    cached, every = rig(rigs), rig(rigs, static_interval=0.0)
    for _ in range(6):
        assert comparable(cached.poll()) == comparable(every.poll())
    assert cached.asked() == dict.fromkeys(STATIC, 1)
    assert every.asked() == dict.fromkeys(STATIC, 6)
    assert cached.client.count(0, "temperature(0)") == 6  # the rest is read every poll
    names = {s.name for s in cached.poll()}
    assert {
        "gpuwatchd_gpu_clock_application_hertz",
        "gpuwatchd_gpu_ecc_enabled",
        "gpuwatchd_gpu_mig_mode",
    } <= names
    cached.poll(advance=300.0)  # the interval has passed: asked again
    assert cached.asked() == dict.fromkeys(STATIC, 2)


@pytest.mark.parametrize(
    ("capture", "cached_polls"),
    [
        ("h100-mig-instances-record.json", 1),
        ("h100-gpm-record.json", 1),
        ("h200x2-record.json", 1),
        ("h100-mig-record.json", 4),  # MIG on without a MIG device: asked every poll
    ],
)
def test_every_capture_reads_the_same_with_the_cache(
    rigs: list[Rig], capture: str, cached_polls: int
) -> None:
    cached = rig(rigs, capture=NVML / capture)
    every = rig(rigs, capture=NVML / capture, static_interval=0.0)
    for _ in range(4):
        assert comparable(cached.poll()) == comparable(every.poll())
    assert cached.client.count(0, "ecc_mode") == cached_polls
    assert every.client.count(0, "ecc_mode") == 4
    slots = every.client.count(0, "max_mig_device_count")  # asked while MIG is on
    assert cached.client.count(0, "max_mig_device_count") == min(slots, cached_polls)


def test_a_failed_static_read_is_asked_again_next_poll(rigs: list[Rig]) -> None:
    r = rig(rigs, script=[{"device": 0, "call": "ecc_mode", "until_poll": 3, "error": "UNKNOWN"}])
    r.poll()
    r.poll()
    samples = r.poll()  # poll 3: ecc_mode answers again
    assert r.client.count(0, "ecc_mode") == 3
    assert [s.value for s in samples if s.name == "gpuwatchd_gpu_ecc_enabled"] == [1, 1]
    assert r.asked()["applications_clock(0)"] == 1  # the others stayed cached meanwhile
    r.poll()  # poll 4: a call that failed answers again: everything is read afresh
    assert r.asked() == dict.fromkeys(STATIC, 2) | {"ecc_mode": 4}
    r.poll()
    r.poll()
    assert r.asked() == dict.fromkeys(STATIC, 2) | {"ecc_mode": 4}


def test_reset_fields_and_new_failures_drop_the_cache(rigs: list[Rig]) -> None:
    reset = {"device": 0, "call": "NVML_FI_DEV_RESET_STATUS@0", "value": 1}
    hot = {"device": 0, "call": "temperature(0)", "error": "UNKNOWN"}
    r = rig(
        rigs,
        script=[reset | {"from_poll": 3, "until_poll": 5}, hot | {"from_poll": 8, "until_poll": 9}],
    )
    r.poll()
    r.poll()
    assert r.asked()["mig_mode"] == 1
    r.poll()  # poll 3: a reset is required (read from the field values each poll)
    assert r.asked()["mig_mode"] == 1
    r.poll()  # 4: read afresh, and again on 5 while the field is still set on 4
    r.poll()  # 5: the reset is done; what this poll read is already after it
    r.poll()  # 6: steady
    assert r.asked()["mig_mode"] == 3
    r.poll()  # 7: steady
    r.poll()  # 8: temperature fails for the first time
    assert r.asked()["mig_mode"] == 3
    r.poll()  # 9: read afresh
    r.poll()  # 10, 11: steady
    r.poll()
    assert r.asked()["mig_mode"] == 4


def test_a_pending_mig_change_is_read_every_poll(rigs: list[Rig]) -> None:
    r = rig(rigs, script=[{"device": 0, "call": "mig_mode", "value": [0, 1]}])
    for _ in range(4):
        samples = r.poll()
    assert r.client.count(0, "mig_mode") == 4
    assert r.asked()["ecc_mode"] == 4  # the whole cache goes while the change is pending
    pending = [s.value for s in samples if s.name == "gpuwatchd_gpu_mig_mode"]
    assert pending == [0, 1]


def test_an_unresponsive_gpu_is_read_afresh_when_it_answers_again(rigs: list[Rig]) -> None:
    r = rig(
        rigs,
        script=[{"device": 0, "call": "*", "from_poll": 3, "until_poll": 4, "error": "UNKNOWN"}],
    )
    r.poll()
    r.poll()
    assert r.asked()["ecc_mode"] == 1
    r.poll()  # poll 3: the whole GPU fails (its handle is dropped)
    r.poll()
    assert r.asked()["ecc_mode"] == 2


def test_an_nvml_xid_makes_the_next_poll_read_afresh(rigs: list[Rig]) -> None:
    seen = threading.Event()
    r = rig(
        rigs, script=[{"device": 0, "from_poll": 3, "xid": 79}], xid_events=True, nudge=seen.set
    )
    r.poll()
    r.poll()
    r.poll()  # poll 3: the Xid is due
    assert seen.wait(10.0)  # the event thread took it
    # The poll that drains the Xid (poll 3 itself when the event thread was quicker than
    # the rest of that poll, else poll 4) marks the GPU; the poll after it reads afresh.
    asked = []
    for _ in range(3):
        r.poll()
        asked.append(r.asked()["ecc_mode"])
    assert asked in ([1, 2, 2], [2, 2, 2]), asked  # once afresh, then static again


def test_an_nvml_xid_event_carries_typed_fields_from_its_listener(rigs: list[Rig]) -> None:
    """NVML's Xid events are built with their XidFields (GPU, UUID, the API), not read
    back from strings; their attrs are that payload's view."""
    seen = threading.Event()
    r = rig(
        rigs, script=[{"device": 0, "from_poll": 3, "xid": 79}], xid_events=True, nudge=seen.set
    )
    for _ in range(3):
        r.poll()
    assert seen.wait(10.0)
    (ev,) = [e for e in r.source.poll(r.clock.time()) if isinstance(e, Event)]
    xid = ev.xid
    assert xid is not None and (xid.code, xid.gpu, xid.via) == (79, "0", "nvml_event")
    assert xid.uuid.startswith("GPU-") and ev.attrs == xid.attrs()
    assert ("uuid", xid.uuid) in ev.attrs


def test_static_interval_is_validated() -> None:
    assert (
        load_text("sources:\n  nvml:\n    static_interval: 0\n").sources.nvml.static_interval == 0
    )
    with pytest.raises(ConfigError, match="static_interval"):
        load_text("sources:\n  nvml:\n    static_interval: -1\n")
    with pytest.raises(ConfigError, match="static_interval"):
        load_text("sources:\n  nvml:\n    static_interval: 100000\n")
