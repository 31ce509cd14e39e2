"""InfinibandSource over sysfs trees laid out as on real hosts (tests/fixtures/sys)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from gpuwatchd.config import load_text
from gpuwatchd.errors import ConfigError
from gpuwatchd.model import Event, Gpu, GpuInventory, Sample
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources import SourceContext
from gpuwatchd.sources.infiniband.source import InfinibandSource
from gpuwatchd.sources.infiniband.sysfs import parse_counter, parse_rate, parse_state

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sys"
# The NVML source's GPUs (daemon: ctx.gpus).
GPUS = GpuInventory(
    (
        Gpu(index=0, uuid="GPU-a", pci_bus_id="0000:19:00.0"),
        Gpu(index=1, uuid="GPU-b", pci_bus_id="0000:1b:00.0"),
        Gpu(index=2, uuid="GPU-c", pci_bus_id="0000:3b:00.0"),
        Gpu(index=3, uuid="GPU-d", pci_bus_id="0000:9d:00.0"),
    )
)


def by(items: list[Sample | Event], name: str) -> dict[tuple[str, ...], float]:
    """(device, port[, extra labels]) -> value for one family."""
    out = {}
    for s in items:
        if isinstance(s, Sample) and s.name == name:
            key = tuple(v for k, v in s.labels if k not in ("device", "port"))
            out[(s.label("device"), s.label("port"), *key)] = s.value
    return out


def copy_tree(tmp_path: Path) -> Path:
    dst = tmp_path / "sys"
    shutil.copytree(FIXTURE, dst, symlinks=True)
    return dst


def port_file(root: Path, device: str, port: str, *rest: str) -> Path:
    return root / "class" / "infiniband" / device / "ports" / port / Path(*rest)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4: ACTIVE\n", (4, "ACTIVE")),
        ("1: DOWN", (1, "DOWN")),
        ("5: LinkUp\n", (5, "LinkUp")),
        ("7: Phy Test\n", (7, "Phy Test")),
        ("ACTIVE", None),
        ("x: ACTIVE", None),
        ("", None),
    ],
)
def test_parse_state(text: str, expected: tuple[int, str] | None) -> None:
    assert parse_state(text) == expected


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("100 Gb/sec (4X EDR)\n", 100),
        ("400 Gb/sec (4X NDR)", 400),
        ("25 Gb/sec (1X EDR)", 25),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("10 Gb/sec (4X)", 10),  # i40iw prints no speed name
        ("Gb/sec", None),
        ("fast", None),
        ("100 Mb/sec", None),
    ],
)
def test_parse_rate_returns_bytes_per_second(text: str, gbps: float | None) -> None:
    got = parse_rate(text)
    assert got == (None if gbps is None else gbps * 1e9 / 8)


@pytest.mark.parametrize(
    ("text", "value"),
    [("0\n", 0), ("18126345378\n", 18126345378), ("N/A (no PMA)\n", None), ("", None), ("x", None)],
)
def test_parse_counter(text: str, value: int | None) -> None:
    assert parse_counter(text) == value


def test_ports_states_and_link_layers() -> None:
    items = list(InfinibandSource(str(FIXTURE)).poll(0))
    info = by(items, "gpuwatchd_infiniband_port_info")
    assert info == {
        ("i40iw0", "1", "InfiniBand", "LinkUp", "ACTIVE"): 1,
        ("mlx4_0", "1", "InfiniBand", "LinkUp", "ACTIVE"): 1,
        ("mlx4_0", "2", "InfiniBand", "Disabled", "DOWN"): 1,
        ("mlx5_0", "1", "InfiniBand", "LinkUp", "ACTIVE"): 1,
        ("mlx5_1", "1", "Ethernet", "LinkUp", "ACTIVE"): 1,  # RoCE
    }
    state = by(items, "gpuwatchd_infiniband_state_id")
    phys = by(items, "gpuwatchd_infiniband_physical_state_id")
    assert state[("mlx4_0", "2")] == 1 and phys[("mlx4_0", "2")] == 3
    assert state[("mlx5_0", "1")] == 4 and phys[("mlx5_0", "1")] == 5
    rate = by(items, "gpuwatchd_infiniband_rate_bytes_per_second")
    assert rate[("mlx5_1", "1")] == 12.5e9 and rate[("mlx4_0", "1")] == 5e9
    assert (
        by(items, "gpuwatchd_infiniband_info")[
            ("mlx5_0", "", "SM_2001000001034", "14.28.2006", "MT4118")
        ]
        == 1
    )


def test_data_counters_are_bytes_and_others_raw() -> None:
    items = list(InfinibandSource(str(FIXTURE)).poll(0))
    rx = by(items, "gpuwatchd_infiniband_port_data_received_bytes_total")
    tx = by(items, "gpuwatchd_infiniband_port_data_transmitted_bytes_total")
    assert rx[("mlx5_0", "1")] == 18126345378 * 4
    assert tx[("mlx5_0", "1")] == 2880761508848 * 4
    pkts = by(items, "gpuwatchd_infiniband_port_packets_received_total")
    assert pkts[("mlx5_0", "1")] == 541889824
    assert by(items, "gpuwatchd_infiniband_port_discards_transmitted_total")[("mlx4_0", "1")] == 5
    # a 32-bit PMA counter at its saturation value is exported as the kernel shows it
    assert by(items, "gpuwatchd_infiniband_port_transmit_wait_total")[("mlx4_0", "1")] == 2**32 - 1


def test_na_no_pma_counters_are_absent_not_zero() -> None:
    items = list(InfinibandSource(str(FIXTURE)).poll(0))
    i40iw = [
        s
        for s in items
        if isinstance(s, Sample) and s.label("device") == "i40iw0" and s.name.endswith("_total")
    ]
    assert [s.name for s in i40iw] == ["gpuwatchd_infiniband_port_stats_resets_total"]
    assert by(items, "gpuwatchd_infiniband_state_id")[("i40iw0", "1")] == 4
    errors = by(items, "gpuwatchd_infiniband_read_errors_total")
    assert errors == {}  # N/A is not an error


def test_hw_counters_exported_except_settings() -> None:
    items = list(InfinibandSource(str(FIXTURE)).poll(0))
    hw = by(items, "gpuwatchd_infiniband_hw_counters_total")
    assert hw[("mlx5_0", "1", "local_ack_timeout_err")] == 131
    assert hw[("mlx5_1", "1", "np_cnp_sent")] == 12
    assert ("mlx5_0", "1", "lifespan") not in hw
    off = list(InfinibandSource(str(FIXTURE), hw_counters=False).poll(0))
    assert by(off, "gpuwatchd_infiniband_hw_counters_total") == {}


def test_gpu_affinity_by_pcie_switch_root_complex_and_numa() -> None:
    src = InfinibandSource(str(FIXTURE), gpus=lambda: GPUS)
    items = list(src.poll(0))
    aff = by(items, "gpuwatchd_infiniband_gpu_affinity_info")  # (device, "", affinity, gpu)
    assert set(aff) == {
        ("mlx5_0", "", "pcie_switch", "0"),
        ("mlx5_0", "", "pcie_switch", "1"),
        ("mlx5_0", "", "numa_node", "2"),
        ("mlx5_1", "", "pcie_switch", "2"),
        ("mlx5_1", "", "numa_node", "0"),
        ("mlx5_1", "", "numa_node", "1"),
        ("i40iw0", "", "host_bridge", "2"),
        ("i40iw0", "", "numa_node", "0"),
        ("i40iw0", "", "numa_node", "1"),
        ("mlx4_0", "", "numa_node", "3"),
    }
    status = src.status()["gpu_affinity"]
    assert status == {
        "i40iw0": {"numa_node": ["0", "1"], "host_bridge": ["2"]},
        "mlx4_0": {"numa_node": ["3"]},
        "mlx5_0": {"pcie_switch": ["0", "1"], "numa_node": ["2"]},
        "mlx5_1": {"numa_node": ["0", "1"], "pcie_switch": ["2"]},
    }


def test_no_gpus_no_affinity_series() -> None:
    items = list(InfinibandSource(str(FIXTURE)).poll(0))
    assert by(items, "gpuwatchd_infiniband_gpu_affinity_info") == {}


def test_counter_reset_is_counted_and_values_exported_as_read(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    first = list(src.poll(0))
    assert by(first, "gpuwatchd_infiniband_port_stats_resets_total")[("mlx5_0", "1")] == 0
    port_file(root, "mlx5_0", "1", "counters", "port_rcv_packets").write_text("12\n")
    second = list(src.poll(1))
    assert by(second, "gpuwatchd_infiniband_port_stats_resets_total")[("mlx5_0", "1")] == 1
    assert by(second, "gpuwatchd_infiniband_port_packets_received_total")[("mlx5_0", "1")] == 12
    assert by(second, "gpuwatchd_infiniband_port_stats_resets_total")[("mlx4_0", "1")] == 0
    third = list(src.poll(2))  # counting up again from 12 is no reset
    assert by(third, "gpuwatchd_infiniband_port_stats_resets_total")[("mlx5_0", "1")] == 1


def test_port_that_was_active_stays_expected_up_when_it_goes_down(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    up = by(list(src.poll(0)), "gpuwatchd_infiniband_port_expected_up")
    assert up[("mlx4_0", "1")] == 1
    assert up[("mlx4_0", "2")] == 0  # never seen ACTIVE: an unused port is no alarm
    port_file(root, "mlx4_0", "1", "state").write_text("1: DOWN\n")
    port_file(root, "mlx4_0", "1", "phys_state").write_text("2: Polling\n")
    items = list(src.poll(1))
    assert by(items, "gpuwatchd_infiniband_port_expected_up")[("mlx4_0", "1")] == 1
    assert by(items, "gpuwatchd_infiniband_state_id")[("mlx4_0", "1")] == 1


def test_expected_rate_from_config_else_highest_seen(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(
        str(root), expected_rate_gbps={"mlx5_0": 100, "mlx4_0/2": 40}, expected_up="^mlx4_0/2$"
    )
    items = list(src.poll(0))
    want = by(items, "gpuwatchd_infiniband_expected_rate_bytes_per_second")
    assert want[("mlx5_0", "1")] == 12.5e9
    assert want[("mlx4_0", "2")] == 5e9
    assert want[("mlx4_0", "1")] == 5e9  # highest seen: its own 40 Gb/s
    assert by(items, "gpuwatchd_infiniband_port_expected_up")[("mlx4_0", "2")] == 1
    port_file(root, "mlx4_0", "1", "rate").write_text("20 Gb/sec (4X DDR)\n")
    items = list(src.poll(1))
    assert by(items, "gpuwatchd_infiniband_rate_bytes_per_second")[("mlx4_0", "1")] == 2.5e9
    assert by(items, "gpuwatchd_infiniband_expected_rate_bytes_per_second")[("mlx4_0", "1")] == 5e9


def test_device_include_and_exclude() -> None:
    items = list(InfinibandSource(str(FIXTURE), include="^mlx", exclude="mlx4").poll(0))
    devices = {s.label("device") for s in items if isinstance(s, Sample) and s.label("device")}
    assert devices == {"mlx5_0", "mlx5_1"}


def test_bad_regex_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="device_include"):
        InfinibandSource(str(FIXTURE), include="(")


def test_no_infiniband_exports_nothing_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "gpuwatchd.infiniband")
    src = InfinibandSource(str(tmp_path))
    assert list(src.poll(0)) == []
    assert list(src.poll(1)) == []
    assert caplog.text.count("no InfiniBand") == 1
    assert src.status()["present"] is False


def test_unparsable_files_are_counted_not_fatal(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    port_file(root, "mlx5_0", "1", "counters", "symbol_error").write_text("garbage\n")
    port_file(root, "mlx5_0", "1", "rate").write_text("unknown\n")
    items = list(InfinibandSource(str(root)).poll(0))
    assert by(items, "gpuwatchd_infiniband_read_errors_total") == {("", "", "unparsable"): 2}
    assert ("mlx5_0", "1") not in by(items, "gpuwatchd_infiniband_symbol_error_total")
    assert ("mlx5_0", "1") not in by(items, "gpuwatchd_infiniband_rate_bytes_per_second")
    assert by(items, "gpuwatchd_infiniband_state_id")[("mlx5_0", "1")] == 4


def test_a_device_that_disappears_and_returns_starts_afresh(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = InfinibandSource(str(root))
    src.poll(0)
    link = root / "class" / "infiniband" / "mlx5_0"
    target = link.readlink()
    link.unlink()
    assert ("mlx5_0", "1") not in by(list(src.poll(1)), "gpuwatchd_infiniband_state_id")
    link.symlink_to(target)
    port_file(root, "mlx5_0", "1", "counters", "port_rcv_packets").write_text("3\n")
    items = list(src.poll(2))
    assert by(items, "gpuwatchd_infiniband_port_stats_resets_total")[("mlx5_0", "1")] == 0


def test_from_config_and_bus_id_normalisation() -> None:
    cfg = load_text(f"paths: {{sysfs: {FIXTURE}}}\nsources: {{infiniband: {{hw_counters: false}}}}")
    src = InfinibandSource.from_config(cfg, SourceContext(gpus=lambda: GPUS))
    items = list(src.poll(0))
    assert by(items, "gpuwatchd_infiniband_hw_counters_total") == {}
    assert ("mlx5_0", "", "pcie_switch", "0") in by(items, "gpuwatchd_infiniband_gpu_affinity_info")
    assert normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bus_id("0000:1b:00.0") == "0000:1b:00.0"
