"""NvmlSource over the other real captures: eight GPUs, Xid events, `gpuwatchd record` runs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config.load import load_text as load_config_text
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.nvml.events import XidListener
from gpuwatchd.sources.nvml.replay import ReplayClient, load_capture
from gpuwatchd.sources.nvml.source import NvmlSource
from tests.health.snapshots import GPU1
from tests.sources.nvml_rigs import (
    FIXTURES,
    H200X2,
    H200X8,
    Rig,
    find,
    rig,
    value,
)


def test_eight_gpu_replay(rigs: list[Rig]) -> None:
    samples = rig(rigs, H200X8).poll()
    assert value(samples, "gpuwatchd_gpus_visible") == 8
    infos = find(samples, "gpuwatchd_gpu_info")
    assert len({s.label("uuid") for s in infos}) == 8
    assert sorted(s.label("pci_bus_id") for s in infos) == [
        f"0000:00:{d:02x}.0" for d in range(6, 14)
    ]
    temps = [
        value(samples, "gpuwatchd_gpu_temperature_celsius", gpu=str(i), sensor="gpu")
        for i in range(8)
    ]
    assert temps == [34, 35] * 4


def test_xid_events_from_a_replay(rigs: list[Rig]) -> None:
    r = rig(rigs, script=[{"device": 1, "from_poll": 2, "xid": 79}])
    assert r.source.open_xid_events() is None  # before init
    r.poll()
    events = r.source.open_xid_events()
    assert events is not None
    assert events.wait(0.05) is None  # not due before poll 2
    r.poll()
    event = events.wait(1.0)
    assert event is not None
    assert (event.uuid, event.pci_bus_id, event.code) == (GPU1["uuid"], GPU1["pci_bus_id"], 79)
    assert event.time == r.clock.time()
    assert events.wait(0.02) is None  # delivered once
    events.close()


# --- captures recorded with `gpuwatchd record` on real GPU machines --------------------

H200X2_RECORD = FIXTURES / "h200x2-record.json"
H100_RECORD = FIXTURES / "h100-record.json"
H200X4 = {k: FIXTURES / f"h200x4-{k}-record.json" for k in ("idle", "load", "hang")}


@pytest.mark.parametrize(
    "path", [H200X2, H200X8, H200X2_RECORD, H100_RECORD, *H200X4.values()], ids=lambda p: p.stem
)
def test_every_capture_replays_cleanly(rigs: list[Rig], path: Path) -> None:
    capture = load_capture(path)
    samples = rig(rigs, path).poll()
    count = len(capture["devices"])
    assert value(samples, "gpuwatchd_gpus_visible") == count
    for i in range(count):
        assert value(samples, "gpuwatchd_gpu_nvml_state", gpu=str(i)) == 0
        assert find(samples, "gpuwatchd_gpu_temperature_celsius", gpu=str(i), sensor="gpu")


def test_recorded_polls_replay_in_order(rigs: list[Rig]) -> None:
    r = rig(rigs, H200X2_RECORD)
    polls = [r.poll() for _ in range(4)]
    energy = [value(p, "gpuwatchd_gpu_energy_joules_total", gpu="0") for p in polls]
    assert energy == [2216.273, 2325.181, 2426.861, 2426.861]  # the last answer repeats
    power = [value(p, "gpuwatchd_gpu_power_watts", gpu="1") for p in polls]
    assert power == [120.03, 76.589, 76.388, 76.388]
    last = polls[-1]
    assert value(last, "gpuwatchd_gpu_recovery_action", gpu="1") == 0
    assert value(last, "gpuwatchd_gpu_recovery_action_info", gpu="1", action="none") == 1
    corrected = "gpuwatchd_nvlink_corrected_errors_total"
    assert value(last, corrected, gpu="0", link="0", error="crc_data") == 9
    # recorded before the daemon read NVML_FI_DEV_NVLINK_ERROR_DL_*: replay and
    # recovery come from the data-link counters, CRC is absent
    assert value(last, "gpuwatchd_nvlink_errors_total", gpu="0", link="0", error="replay") == 0
    assert not find(last, "gpuwatchd_nvlink_errors_total", gpu="0", link="0", error="crc")
    assert len(find(last, "gpuwatchd_nvlink_up", gpu="0")) == 18


def test_recovery_action_scripted_on_a_recorded_value(rigs: list[Rig]) -> None:
    r = rig(
        rigs,
        H200X2_RECORD,
        script=[
            {
                "device": 0,
                "call": "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION@0",
                "from_poll": 2,
                "value": 4,
            },
        ],
    )
    r.poll()
    samples = r.poll()
    assert value(samples, "gpuwatchd_gpu_recovery_action", gpu="0") == 4
    assert (
        value(samples, "gpuwatchd_gpu_recovery_action_info", gpu="0", action="drain_and_reset") == 1
    )
    assert find(samples, "gpuwatchd_gpu_recovery_action_info", gpu="0", action="none") == []
    gpus: Any = r.source.status()["gpus"]
    assert gpus["0000:00:06.0"]["last"]["recovery_action"] == "drain_and_reset"


def test_a_gpu_without_nvlink_has_no_link_series(rigs: list[Rig]) -> None:
    r = rig(rigs, H100_RECORD)
    r.poll()
    samples = r.poll()
    assert not [s for s in samples if s.name.startswith("gpuwatchd_nvlink_")]
    assert r.client.count(0, "nvlink_state(7)") == 1  # NOT_SUPPORTED once, then never
    assert value(samples, "gpuwatchd_gpu_temperature_celsius", gpu="0", sensor="memory") == 40


def test_4xh200_under_nccl_load_reads_no_nvlink_error_as_nvidia_smi_does(rigs: list[Rig]) -> None:
    """DDP on all four GPUs (the load capture): `nvidia-smi nvlink -e` read 0 on all 72
    links at that moment; the corrected-error counters are exported apart."""
    r = rig(rigs, H200X4["load"])
    r.poll()
    samples = r.poll()
    errors = find(samples, "gpuwatchd_nvlink_errors_total")
    assert len(errors) == 4 * 18 * 3 and all(s.value == 0 for s in errors)
    assert len(find(samples, "gpuwatchd_nvlink_up")) == 4 * 18
    assert find(samples, "gpuwatchd_nvlink_corrected_errors_total")


def test_4xh200_hang_capture_reads_the_dead_peers_survivor_busy(rigs: list[Rig]) -> None:
    """13:54-13:55 UTC: rank 1 on GPU 1 was SIGKILLed, rank 0 on GPU 0 waits in an
    all_reduce, GPUs 2-3 train another job. NVML reads the survivor's GPU busy (1.0) at
    training's level of utilisation, GPM shows its SM activity (0.18) and power (118 W)
    far below the training pair's (0.31-0.34, 277-293 W): utilisation is no progress."""
    r = rig(rigs, H200X4["hang"])
    r.poll()
    for _ in range(3):
        samples = r.poll()
        util = {
            dict(x.labels)["gpu"]: x.value
            for x in find(samples, "gpuwatchd_gpu_utilization_ratio")
            if dict(x.labels).get("engine") == "gpu"
        }
        sm = {
            dict(x.labels)["gpu"]: x.value for x in find(samples, "gpuwatchd_gpu_sm_active_ratio")
        }
        watts = {dict(x.labels)["gpu"]: x.value for x in find(samples, "gpuwatchd_gpu_power_watts")}
        assert util["0"] == 1.0 and util["1"] == 0.0 and 0.5 <= min(util["2"], util["3"])
        assert 0.15 <= sm["0"] <= 0.2 and min(sm["2"], sm["3"]) >= 0.3
        assert watts["0"] < 130 < 270 < min(watts["2"], watts["3"])


# --- the replay blocks as libnvidia-ml does -----------------------------------------


def test_replay_event_wait_blocks_for_its_timeout_and_free_waits_for_it(rigs: list[Rig]) -> None:
    """nvmlEventSetWait returns at an event or its timeout, and nvmlEventSetFree waits
    for a wait in flight (on H200 a one-shot check sat 5.1 s in the free)."""
    r = rig(rigs)
    r.poll()
    events = r.source.open_xid_events()
    assert events is not None
    waiting = threading.Thread(target=events.wait, args=(0.6,))
    t0 = time.monotonic()
    waiting.start()
    time.sleep(0.05)
    events.close()
    assert time.monotonic() - t0 >= 0.55  # the free waited for the wait
    waiting.join()


def test_xid_listener_stops_within_a_wait_slice(rigs: list[Rig]) -> None:
    r = rig(rigs)
    r.poll()
    events = r.source.open_xid_events()
    assert events is not None
    listener = XidListener(events, lambda: None)
    time.sleep(0.1)  # the thread is inside a wait now
    t0 = time.monotonic()
    listener.close()
    assert time.monotonic() - t0 < 2.5  # it was 5 s: the whole driver wait


def test_one_shot_check_opens_no_event_set(tmp_path: Path) -> None:
    """`check` exits at once: it must not start a listener whose set it then waits to free."""
    cfg = load_config_text(f"sources:\n  nvml:\n    replay: {H200X2}\n    xid_events: true\n")
    daemon = NvmlSource.from_config(cfg, SourceContext())
    one_shot = NvmlSource.from_config(cfg, SourceContext(one_shot=True))
    try:
        for source in (daemon, one_shot):
            source.poll(time.time())
            source.poll(time.time())
        assert daemon._xid_listener is not None
        assert one_shot._xid_listener is None
    finally:
        daemon.close()
        one_shot.close()


def test_replay_from_config_blocks_as_long_as_the_recorded_calls() -> None:
    capture = load_capture(H200X2)
    recorded_init = capture["init"][0]["us"] / 1e6
    cfg = load_config_text(f"sources:\n  nvml:\n    replay: {H200X2}\n")
    source = NvmlSource.from_config(cfg, SourceContext())
    try:
        assert isinstance(source.client, ReplayClient)
        t0 = time.monotonic()
        source.client.init()
        assert time.monotonic() - t0 >= recorded_init
    finally:
        source.close()
