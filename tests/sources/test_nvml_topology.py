"""GPU topology (what `nvidia-smi topo -m` prints) from NVML and sysfs, on /status and in check.

The 2x H200 capture predates the topology calls: replayed as is, every
relation is unknown, never guessed. The same capture with the calls answered
as that machine answers them (its 18 NVLinks each end at the other GPU, CPUs
0-31, NUMA node 0; tests/fixtures/nvidia-smi/h200x2-topo-m.txt is the real
`nvidia-smi topo -m`) must give the same matrix nvidia-smi printed. The PCI
levels and nearest NICs come from the fixture sysfs tree (tests/fixtures/sys).

The 2x H100 capture (a Firecracker VM) was recorded with the topology calls:
NVML hid every link's far end (FFFFFFFF:FF:FF.0) and said PHB for the pair,
while `nvidia-smi topo -m` (tests/fixtures/nvidia-smi/h100x2-topo-m.txt) printed
NV18; the replay must print NV18 too.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.model import Topology
from gpuwatchd.pci import pci_place, smi_relation
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource
from gpuwatchd.sources.nvml.topology import GpuLinks, assemble, cpu_list

ROOT = Path(__file__).resolve().parents[2]
SYS = ROOT / "tests" / "fixtures" / "sys"
RECORD = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-record.json"
TOPO_M = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h200x2-topo-m.txt"
H100X2 = ROOT / "tests" / "fixtures" / "nvml" / "h100x2-idle-record.json"
H100X2_TOPO_M = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100x2-topo-m.txt"
BUSES = ("0000:00:06.0", "0000:00:07.0")


def smi() -> ModuleType:
    spec = importlib.util.spec_from_file_location("smi_nvlink", ROOT / "tests/gpu/smi_nvlink.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_masks_print_as_the_kernel_lists_cpus() -> None:
    assert cpu_list([0xFFFFFFFF]) == "0-31"
    assert cpu_list([0b1011]) == "0-1,3"
    assert cpu_list([0, 0xFFFF]) == "64-79"
    assert cpu_list([]) == ""


def place(bus: str) -> Any:
    return pci_place(str(SYS), str(SYS / "bus" / "pci" / "devices" / bus))


def nic(name: str) -> Any:
    return pci_place(str(SYS), str(SYS / "class" / "infiniband" / name / "device"))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (place("0000:19:00.0"), place("0000:1b:00.0"), "PIX"),  # GPUs 0, 1: one switch
        (place("0000:19:00.0"), nic("mlx5_0"), "PIX"),
        (place("0000:3b:00.0"), nic("i40iw0"), "PHB"),  # same root complex
        (place("0000:19:00.0"), place("0000:3b:00.0"), "NODE"),  # other root, same NUMA
        (place("0000:9d:00.0"), nic("mlx4_0"), "NODE"),
        (place("0000:19:00.0"), place("0000:9d:00.0"), "SYS"),
    ],
)
def test_pci_levels_from_sysfs(a: Any, b: Any, expected: str) -> None:
    assert smi_relation(a, b) == expected == smi_relation(b, a)


def test_without_nvlink_the_sysfs_levels_and_nearest_nics() -> None:
    gpus = [(0, "0000:19:00.0", "a"), (1, "0000:1b:00.0", "b"), (3, "0000:9d:00.0", "d")]
    no_nvlink = GpuLinks({}, {}, "")
    topo = assemble(gpus, dict.fromkeys((0, 1, 3), no_nvlink), str(SYS))
    by = {g.index: g for g in topo.gpus}
    assert dict(by[0].peers) == {1: "PIX", 3: "SYS"}
    assert by[0].nics == (("mlx5_0", "PIX"),)
    assert by[3].nics == (("mlx4_0", "NODE"),) and by[3].numa_node == 1
    assert by[0].cpu_affinity == ""  # NVML did not say


def test_nvswitch_links_count_for_every_pair() -> None:
    # HGX: each GPU's 18 links end at NVSwitches, none at another GPU
    switches = {f"0000:{0x80 + i:02x}:00.0": 3 for i in range(6)}
    links = {i: GpuLinks(switches, {}, "") for i in range(3)}
    gpus = [(i, f"0000:{0x10 + i:02x}:00.0", "") for i in range(3)]
    topo = assemble(gpus, links, "/nonexistent")
    assert {rel for g in topo.gpus for _, rel in g.peers} == {"NV18"}


def topology_calls(capture: dict[str, Any]) -> dict[str, Any]:
    """The capture with the topology calls answered as the real machine's topo -m says."""
    doc = copy.deepcopy(capture)
    for i, dev in enumerate(doc["devices"]):
        calls = dev["calls"]
        peer = BUSES[1 - i]
        for link in range(18):
            calls[f"nvlink_remote_pci_info({link})"] = [{"value": {"busId": f"0000{peer}"}}]
        calls["cpu_affinity"] = [{"value": [0xFFFFFFFF]}]
        calls[f"topology_common_ancestor({1 - i})"] = [{"value": 30}]
    return doc


def vm_sysfs(tmp: Path) -> Path:
    """The two GPUs on the VM's root bus, NUMA node 0 (no RDMA devices)."""
    for bus in BUSES:
        dev = tmp / "devices" / "pci0000:00" / bus
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text("0\n")
        link = tmp / "bus" / "pci" / "devices" / bus
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(dev, link.parent), link)
    return tmp


def polled_topology(capture: Path, sysfs: Path) -> Topology | None:
    source = NvmlSource(
        ReplayClient.load(capture, clock=FakeClock()), call_timeout=2.0, sysfs=str(sysfs)
    )
    try:
        source.poll(0.0)
        first = source.inventory().topology
        source.poll(10.0)
        assert source.inventory().topology is first  # read once, not each poll
        doc = json.loads(json.dumps(source.status()))  # what /status serves
        assert doc["topology"] == (first.as_json() if first else None)
    finally:
        source.close()
    return first


def test_old_capture_topology_is_unknown(tmp_path: Path) -> None:
    topo = polled_topology(RECORD, vm_sysfs(tmp_path))
    assert topo is not None
    assert topo.as_json()["matrix"] == {
        "GPU0": {"GPU0": "X", "GPU1": "unknown"},
        "GPU1": {"GPU1": "X", "GPU0": "unknown"},
    }


def test_replay_gives_the_machines_nvidia_smi_topo_m(tmp_path: Path) -> None:
    capture = tmp_path / "h200x2-topology.json"
    capture.write_text(json.dumps(topology_calls(json.loads(RECORD.read_text()))))
    topo = polled_topology(capture, vm_sysfs(tmp_path / "sys"))
    assert topo is not None
    expected = smi().parse_topo(TOPO_M.read_text())
    ours = topo.as_json()
    for g in topo.gpus:
        row = expected[f"GPU{g.index}"]
        assert ours["matrix"][f"GPU{g.index}"] == {
            k: v for k, v in row.items() if k.startswith("GPU") and k != "GPU NUMA ID"
        }
        assert g.cpu_affinity == row["CPU Affinity"]
        assert str(g.numa_node) == row["NUMA Affinity"]


def test_record_keeps_the_topology_calls(tmp_path: Path) -> None:
    from gpuwatchd.sources.nvml.record import record

    source = tmp_path / "h200x2-topology.json"
    source.write_text(json.dumps(topology_calls(json.loads(RECORD.read_text()))))
    out = tmp_path / "recorded.json"
    capture = record(out, polls=2, interval=0.0, client=ReplayClient.load(source))
    calls = capture["devices"][0]["calls"]
    assert calls["cpu_affinity"][0]["value"] == [0xFFFFFFFF]
    assert calls["nvlink_remote_pci_info(17)"][0]["value"]["busId"] == "00000000:00:07.0"
    sysfs = vm_sysfs(tmp_path / "sys")
    assert polled_topology(out, sysfs) == polled_topology(source, sysfs)


def hidden(active: int = 18, levels: dict[int, str] | None = None, **kw: Any) -> GpuLinks:
    """A GPU whose every link's far end NVML hides, as in the VM."""
    return GpuLinks({}, levels or {}, "", hidden=active, active=active, **kw)


def matrix(links: dict[int, GpuLinks]) -> dict[int, dict[int, str]]:
    gpus = [(i, f"0000:00:{6 + i:02x}.0", "") for i in sorted(links)]
    return {g.index: dict(g.peers) for g in assemble(gpus, links, "/nonexistent").gpus}


def test_hidden_far_ends_read_from_the_p2p_status() -> None:
    # one NVLink peer (a bridged pair): every up link reaches it
    pair = {0: hidden(12, p2p_nvlink={1: True, 2: False, 3: False}, levels={2: "SYS"})}
    assert matrix({**pair, 1: hidden(), 2: hidden(), 3: hidden()})[0] == {
        1: "NV12",
        2: "SYS",  # NVML said no NVLink: the PCI level
        3: "",  # no NVLink, and no PCI level known
    }
    # three NVLink peers: NV<n> only when the links end at NVSwitches
    mesh = dict.fromkeys((1, 2, 3), True)
    assert set(matrix({i: hidden(p2p_nvlink=mesh) for i in range(4)})[0].values()) == {""}
    switch = {i: hidden(p2p_nvlink=mesh, switched=True) for i in range(4)}
    assert set(matrix(switch)[0].values()) == {"NV18"}


def test_hidden_far_ends_without_p2p_answer() -> None:
    # older captures: the one other GPU takes every up link; more GPUs stay unknown
    assert matrix({0: hidden(), 1: hidden()}) == {0: {1: "NV18"}, 1: {0: "NV18"}}
    assert set(matrix({i: hidden() for i in range(3)})[0].values()) == {""}
    assert matrix({0: hidden(active=0), 1: hidden()})[0] == {1: ""}  # no link up
    # some far ends shown, some hidden: how many reach the peer is unknown
    mixed = GpuLinks({"0000:00:07.0": 2}, {}, "", hidden=16, active=18)
    assert matrix({0: mixed, 1: hidden()})[0] == {1: "NV2"}
    mixed = GpuLinks({"0000:00:99.0": 2}, {}, "", hidden=16, active=18)
    assert matrix({0: mixed, 1: hidden()})[0] == {1: ""}


def test_vm_capture_gives_the_machines_nvidia_smi_topo_m(tmp_path: Path) -> None:
    topo = polled_topology(H100X2, vm_sysfs(tmp_path))
    assert topo is not None
    expected = smi().parse_topo(H100X2_TOPO_M.read_text())
    assert topo.as_json()["matrix"] == {
        "GPU0": {"GPU0": "X", "GPU1": "NV18"},
        "GPU1": {"GPU1": "X", "GPU0": "NV18"},
    }
    for g in topo.gpus:
        row = expected[f"GPU{g.index}"]
        assert dict(g.peers) == {1 - g.index: row[f"GPU{1 - g.index}"]}
        assert g.cpu_affinity == row["CPU Affinity"] == "0-31"
        assert str(g.numa_node) == row["NUMA Affinity"]  # from the sysfs tree here


def test_p2p_and_numa_answers_are_recorded_and_replayed(tmp_path: Path) -> None:
    from gpuwatchd.sources.nvml.record import record

    doc = json.loads(H100X2.read_text())
    for i, dev in enumerate(doc["devices"]):
        dev["calls"][f"p2p_nvlink_status({1 - i})"] = [{"value": 0}]
        dev["calls"]["numa_affinity"] = [{"value": [1]}]
    source = tmp_path / "h100x2-p2p.json"
    source.write_text(json.dumps(doc))
    out = tmp_path / "recorded.json"
    capture = record(out, polls=2, interval=0.0, client=ReplayClient.load(source))
    calls = capture["devices"][1]["calls"]
    assert calls["p2p_nvlink_status(0)"][0]["value"] == 0
    assert calls["numa_affinity"][0]["value"] == [1]
    topo = polled_topology(out, tmp_path / "no-sysfs")
    assert topo is not None
    assert [(g.peers, g.numa_node, g.cpu_affinity) for g in topo.gpus] == [
        (((1, "NV18"),), 0, "0-31"),
        (((0, "NV18"),), 0, "0-31"),
    ]
    # NVML says no NVLink P2P: the pair's PCI level (PHB in the capture), never NV18
    for i, dev in enumerate(doc["devices"]):
        dev["calls"][f"p2p_nvlink_status({1 - i})"] = [
            {"value": 5}
        ]  # NVML_P2P_STATUS_NOT_SUPPORTED
    source.write_text(json.dumps(doc))
    topo = polled_topology(source, tmp_path / "no-sysfs")
    assert topo is not None and [g.peers for g in topo.gpus] == [((1, "PHB"),), ((0, "PHB"),)]
