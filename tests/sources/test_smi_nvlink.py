"""The NVLink rows of tests/gpu/compare_nvidia_smi.py on real nvidia-smi output.

`nvidia-smi nvlink -s`, `-e` and `topo -m` were saved on the 2x H200 machine of
the probe capture (tests/fixtures/nvidia-smi/PROVENANCE.md); the probe's replay
must agree with them row by row. `-gt d` and `dmon` were not saved there: their
parsers are checked on the layout nvidia-smi prints (a few lines written here).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpuwatchd.model import Sample
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "fixtures" / "nvidia-smi"
GPU0 = "GPU-544a204b-219a-29ac-8147-ab3c8c9d52c6"
GPU1 = "GPU-cb99ac69-31a4-2508-9794-b7f3ed611416"


@pytest.fixture(scope="module")
def smi() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "smi_nvlink", ROOT / "tests" / "gpu" / "smi_nvlink.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_status_parses_every_link(smi: ModuleType) -> None:
    status = smi.parse_nvlink_status((SMI / "h200x2-nvlink-s.txt").read_text())
    assert sorted(status) == [GPU0, GPU1]
    assert len(status[GPU0]) == len(status[GPU1]) == 18
    assert set(status[GPU1].values()) == {26.562e9}
    assert smi.parse_nvlink_status("GPU 0: X (UUID: GPU-ab)\n\t Link 3: <inactive>\n") == {
        "GPU-ab": {3: None}
    }


def test_errors_parse_as_gpuwatchd_labels(smi: ModuleType) -> None:
    errors = smi.parse_nvlink_errors((SMI / "h200x2-nvlink-e.txt").read_text())
    assert sorted(errors[GPU0]) == list(range(10))
    assert errors[GPU0][9] == {"replay": 0, "recovery": 0, "crc": 0}


def test_probe_replay_agrees_with_nvlink_s_and_e(smi: ModuleType) -> None:
    source = NvmlSource(
        ReplayClient.load(ROOT / "tests/fixtures/nvml/h200x2-probe.json"), call_timeout=2.0
    )
    try:
        samples = [s for s in source.poll(0.0) if isinstance(s, Sample)]
    finally:
        source.close()
    rows = smi.nvlink_rows(
        samples,
        (SMI / "h200x2-nvlink-s.txt").read_text(),
        (SMI / "h200x2-nvlink-e.txt").read_text(),
    )
    verdicts = {(r["gpu"], r["metric"]): r["verdict"] for r in rows}
    bus0 = "0000:00:06.0"
    # the probe read link 0 of each counter only; nvidia-smi -e read 0 where NVML's
    # data-link counters had corrected CRC (2) and ECC (4) errors
    for error in ("replay", "recovery", "crc"):
        assert (
            verdicts[(bus0, f'gpuwatchd_nvlink_errors_total{{link="0",error="{error}"}}')]
            == "agree"
        )
    for link in range(18):
        assert verdicts[(bus0, f'gpuwatchd_nvlink_up{{link="{link}"}}')] == "agree"
    assert verdicts[(bus0, 'gpuwatchd_nvlink_speed_bytes_per_second{link="0"}')] == "agree"
    assert not [k for k, v in verdicts.items() if v == "MISMATCH"]


def test_throughput_counters_give_rates_per_gpu(smi: ModuleType) -> None:
    def gt(tx: int, rx: int) -> str:
        return (
            f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aa)\n"
            f"\t Link 0: Data Tx: {tx} KiB\n\t Link 0: Data Rx: {rx} KiB\n"
            f"\t Link 1: Data Tx: {tx} KiB\n\t Link 1: Data Rx: {rx} KiB\n"
        )

    before, after = (
        smi.parse_nvlink_throughput(gt(100, 50)),
        smi.parse_nvlink_throughput(gt(2148, 1074)),
    )
    assert before["GPU-aa"][1] == {"data_tx": 100 * 1024, "data_rx": 50 * 1024}
    rates = smi.throughput_rates(before, after, 2.0)
    assert rates == {"GPU-aa": {"data_tx": 2 * 2048 * 1024 / 2, "data_rx": 2 * 1024 * 1024 / 2}}
    samples = [
        Sample.of(
            "gpuwatchd_gpu_nvlink_bytes_per_second",
            2.0e6,
            gpu="0",
            uuid="GPU-aa",
            pci_bus_id="0000:01:00.0",
            direction="tx",
        ),
        Sample.of(
            "gpuwatchd_gpu_nvlink_bytes_per_second",
            9.0e8,
            gpu="0",
            uuid="GPU-aa",
            pci_bus_id="0000:01:00.0",
            direction="rx",
        ),
    ]
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # smi_load imports smi_nvlink
    import smi_load

    rows = {r["metric"]: r["verdict"] for r in smi_load.throughput_rows(samples, rates, 2.0, 2.0)}
    assert rows['gpuwatchd_gpu_nvlink_bytes_per_second{direction="tx"}'] == "agree"
    assert rows['gpuwatchd_gpu_nvlink_bytes_per_second{direction="rx"}'] == "MISMATCH"


def test_dmon_and_utilization_side_by_side(smi: ModuleType) -> None:
    dmon = smi.parse_dmon(
        "# gpu    pwr  gtemp  mtemp     sm    mem    enc    dec    jpg    ofa   mclk   pclk\n"
        "# Idx      W      C      C      %      %      %      %      %      %    MHz    MHz\n"
        "    0    625     61     70    100     45      0      0      0      0   2619   1980\n"
        "    1     72     33      -     17      0      0      0      0      0   2619   1980\n"
    )
    assert dmon[0]["sm"] == 100 and dmon[1]["sm"] == 17 and "mtemp" not in dmon[1]
    util = [
        Sample.of(
            "gpuwatchd_gpu_utilization_ratio",
            v,
            gpu=g,
            uuid=f"GPU-{g}",
            pci_bus_id=f"0000:0{g}:00.0",
            engine="gpu",
        )
        for g, v in (("0", 1.0), ("1", 0.17))
    ]
    query = {"0000:00:00.0": {"utilization.gpu": "100"}, "0000:01:00.0": {"utilization.gpu": "90"}}
    rows = smi.utilization_rows(util, {"GPU-0": 1.0, "GPU-1": 0.17}, query, dmon)
    assert [r["verdict"] for r in rows] == ["agree", "MISMATCH"]
    assert "nvmlDeviceGetUtilizationRates 0.17" in rows[1]["nvidia_smi_text"]


@pytest.fixture(scope="module")
def bw(smi: ModuleType) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "nvlink_bandwidth", ROOT / "tests" / "gpu" / "nvlink_bandwidth.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bandwidth_summary_puts_gpm_beside_nccl(bw: ModuleType) -> None:
    name = "gpuwatchd_gpu_nvlink_bytes_per_second"
    body = (
        f"# TYPE {name} gauge\n"
        f'{name}{{direction="tx",gpu="0",pci_bus_id="a",uuid="GPU-a"}} 3.6e+11\n'
        f'{name}{{direction="rx",gpu="0",pci_bus_id="a",uuid="GPU-a"}} 3.5e+11\n'
    )
    assert bw.parse_gpm(body) == {("0", "tx"): 3.6e11, ("0", "rx"): 3.5e11}
    assert bw.bus_bandwidth(100.0, 4) == 150.0 and bw.bus_bandwidth(100.0, 2) == 100.0
    # a 10 s poll: the value first seen at 11.0 covers 0.5-11.0, partly before the loop
    samples = [
        {"time": t, "gpm": {"0/tx": v, "0/rx": v}, "smi_rates": {"GPU-a": {"data_tx": s}}}
        for t, v, s in (
            (10.5, 0.0, 0.0),
            (11.0, 1.2e11, 3.6e11),
            (20.5, 1.2e11, 3.8e11),
            (21.0, 3.7e11, 3.7e11),
            (30.0, 3.7e11, 3.7e11),
            (31.0, 2.0e11, 0.0),
        )
    ]
    ranks = [{"rank": 0, "busbw_bytes_per_second": 3.7e11}, {"rank": 1}]
    summary = bw.summarize(samples, (10.0, 30.5), ranks, 10.0)
    assert [w["gpm"]["0/tx"] for w in summary["gpm_windows_inside"]] == [3.7e11]
    assert summary["gpm_median_bytes_per_second"] == {"0": {"tx": 3.7e11, "rx": 3.7e11}}
    assert summary["nvidia_smi_gt_median_bytes_per_second"] == {"0": {"data_tx": 3.7e11}}
    assert summary["gpm_tx_over_busbw"] == {"0": 1.0}
    assert 9.5 < bw.infer_gpm_window(samples) < 10.5  # changes seen at 11, 21, 31


def test_topology_rows_against_topo_m(smi: ModuleType) -> None:
    topology = {
        "matrix": {"GPU0": {"GPU0": "X", "GPU1": "NV18"}, "GPU1": {"GPU1": "X", "GPU0": "PHB"}},
        "gpus": [
            {"gpu": 0, "pci_bus_id": "0000:00:06.0", "numa_node": 0, "cpu_affinity": "0-31"},
            {"gpu": 1, "pci_bus_id": "0000:00:07.0", "numa_node": None, "cpu_affinity": None},
        ],
    }
    rows = smi.topology_rows(topology, (SMI / "h200x2-topo-m.txt").read_text())
    verdicts = {r["metric"]: r["verdict"] for r in rows}
    assert verdicts == {
        "topology GPU0-GPU1": "agree",
        "topology GPU1-GPU0": "MISMATCH",
        "topology GPU0 CPU Affinity": "agree",
        "topology GPU0 NUMA Affinity": "agree",
        "topology GPU1 CPU Affinity": "missing in gpuwatchd",
        "topology GPU1 NUMA Affinity": "missing in gpuwatchd",
    }


def test_topology_rows_on_the_2x_h100_topo_m(smi: ModuleType) -> None:
    # the daemon's /status topology of the 2x H100 replay, against that machine's topo -m
    topology = {
        "matrix": {"GPU0": {"GPU0": "X", "GPU1": "NV18"}, "GPU1": {"GPU1": "X", "GPU0": "NV18"}},
        "gpus": [
            {"gpu": 0, "pci_bus_id": "0000:00:06.0", "numa_node": None, "cpu_affinity": "0-31"},
            {"gpu": 1, "pci_bus_id": "0000:00:07.0", "numa_node": 0, "cpu_affinity": "0-31"},
        ],
    }
    text = (SMI / "h100x2-topo-m.txt").read_text()
    assert smi.parse_topo(text)["GPU1"] == {
        "GPU0": "NV18",
        "GPU1": "X",
        "CPU Affinity": "0-31",
        "NUMA Affinity": "0",
        "GPU NUMA ID": "N/A",
    }
    verdicts = {r["metric"]: r["verdict"] for r in smi.topology_rows(topology, text)}
    assert verdicts == {
        "topology GPU0-GPU1": "agree",
        "topology GPU1-GPU0": "agree",
        "topology GPU0 CPU Affinity": "agree",
        "topology GPU0 NUMA Affinity": "missing in gpuwatchd",
        "topology GPU1 CPU Affinity": "agree",
        "topology GPU1 NUMA Affinity": "agree",
    }


H100_0 = "GPU-5fe5b788-2279-1aaf-89bd-ea8041ba9c8d"
H100_1 = "GPU-58cf2fb7-2615-6fe1-283f-8efe2155a985"


def test_real_2x_h100_nvlink_outputs_parse(smi: ModuleType) -> None:
    # idle, 2026-11-26: 18 links a GPU at 26.562 GB/s, no fault counted, no traffic
    status = smi.parse_nvlink_status((SMI / "h100x2-nvlink-s.txt").read_text())
    assert sorted(status) == sorted([H100_0, H100_1])
    assert {link: set() for link in range(18)} == {
        link: {s for s in (status[H100_0][link], status[H100_1][link]) if s != 26.562e9}
        for link in range(18)
    }
    errors = smi.parse_nvlink_errors((SMI / "h100x2-nvlink-e.txt").read_text())
    assert sorted(errors) == sorted([H100_0, H100_1])
    assert all(
        errors[g][link] == {"replay": 0, "recovery": 0, "crc": 0}
        for g in (H100_0, H100_1)
        for link in range(18)
    )
    gt = smi.parse_nvlink_throughput((SMI / "h100x2-nvlink-gt-d.txt").read_text())
    assert sorted(gt) == sorted([H100_0, H100_1])
    assert all(len(gt[g]) == 18 for g in gt)
    assert gt[H100_1][17] == {"data_tx": 0, "data_rx": 0}
