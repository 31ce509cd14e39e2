"""MIG: Xid lines attributed to GPU and compute instances; MIG devices from a real capture."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.model import Gpu, GpuInventory, Sample
from gpuwatchd.sources.kmsg.parse import XID, parse_line
from gpuwatchd.sources.nvml.mig import read_mig
from gpuwatchd.sources.nvml.replay import ReplayClient
from gpuwatchd.sources.nvml.source import NvmlSource

MIG = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h100-mig-record.json"


def test_mig_xid_line_names_its_instances() -> None:
    rec = parse_line(
        "[  200.000000] NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 43, pid=4242, "
        "name=python3, Ch 00000008"
    )
    assert rec is not None and rec.kind == XID
    assert (rec.code, rec.pci_bus_id, rec.pid, rec.process) == (43, "0000:3b:00.0", 4242, "python3")
    assert rec.extra("gpu_instance") == "1" and rec.extra("compute_instance") == "0"
    only_gi = parse_line(
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 31, pid=7, name=a.out, channel 0x0000000a"
    )
    assert only_gi is not None and only_gi.kind == XID
    assert only_gi.extra("gpu_instance") == "2" and only_gi.extra("compute_instance") == ""
    plain = parse_line("NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=x, Ch 00000008")
    assert plain is not None and plain.extra("gpu_instance") == ""


def test_mig_capture_replays_mode_and_empty_slots() -> None:
    # recorded on an H100 test machine right after `nvidia-smi -i 0 -mig 1`, before
    # any GPU instance existed: MIG on, 7 slots, every slot NOT_FOUND
    source = NvmlSource(ReplayClient.load(MIG), call_timeout=2.0)
    try:
        for _ in range(3):
            samples = [s for s in source.poll(0.0) if isinstance(s, Sample)]
        client = source.client
        assert isinstance(client, ReplayClient)
        assert client.count(0, "mig_device(6)") == 3  # asked each poll, not given up on
    finally:
        source.close()

    def get(name: str, **labels: str) -> float | None:
        for s in samples:
            if s.name == name and all(s.label(k) == v for k, v in labels.items()):
                return s.value
        return None

    assert get("gpuwatchd_gpu_mig_mode", which="current") == 1
    assert get("gpuwatchd_gpu_mig_mode", which="pending") == 1
    assert get("gpuwatchd_gpu_mig_devices") == 0
    # utilization is NOT_SUPPORTED on a GPU in MIG mode: absent, as nvidia-smi shows [N/A]
    assert get("gpuwatchd_gpu_utilization_ratio", engine="gpu") is None
    # empty slots are an answer, not an NVML error
    assert get("gpuwatchd_nvml_errors_total", reason="not_found") is None
    assert not [s for s in samples if s.name.startswith("gpuwatchd_mig_")]


def test_mig_devices_become_per_instance_series() -> None:
    # The recorded capture has MIG on but no instances yet, so read_mig is fed what
    # a 3g.40gb instance answers through the client's mig_device call (sizes from
    # `nvidia-smi mig -lgip` on the same H100); a recorded capture with instances
    # is still to be made.
    three_g = {
        "gpu_instance": 1,
        "compute_instance": 0,
        "uuid": "MIG-0b5e6a0c-1d2e-5f3a-9b8c-7d6e5f4a3b2c",
        "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "memory": {"total": 42_412_802_048, "free": 42_000_000_000, "used": 412_802_048},
        "attributes": {"multiprocessors": 60, "gpu_instance_slices": 3},
        "processes": [{"pid": 4242, "used_memory": 400_000_000}],
    }
    answers: dict[str, object] = {
        "mig_mode": [1, 1],
        "max_mig_device_count": 7,
        "mig_device(0)": three_g,
        "gpm_mig_metrics(1)": {"sm_active": 50.0, "tensor_active": 25.0},
    }

    def get(name: str, *args: int) -> object | None:
        return answers.get(f"{name}({','.join(map(str, args))})" if args else name)

    out: list[tuple[str, float, dict[str, object]]] = []
    last: dict[str, object] = {}
    procs = read_mig(get, lambda n, v, **kw: out.append((n, v, kw)), True, last)
    series = {(n, kw.get("gpu_instance"), kw.get("compute_instance")): (v, kw) for n, v, kw in out}
    value, labels = series[("gpuwatchd_mig_device_info", "1", "0")]
    assert value == 1 and labels["profile"] == "3g.40gb" and labels["mig_uuid"] == three_g["uuid"]
    assert series[("gpuwatchd_mig_memory_used_bytes", "1", "0")][0] == 412_802_048
    assert series[("gpuwatchd_mig_multiprocessors", "1", "0")][0] == 60
    assert series[("gpuwatchd_mig_compute_processes", "1", "0")][0] == 1
    assert series[("gpuwatchd_mig_sm_active_ratio", "1", None)][0] == 0.5
    tensor = [kw for n, v, kw in out if n == "gpuwatchd_mig_pipe_active_ratio"]
    assert tensor == [{"pipe": "tensor", "gpu_instance": "1"}]
    assert series[("gpuwatchd_gpu_mig_devices", None, None)][0] == 1
    assert procs == [
        {
            "pid": 4242,
            "used_memory": 400_000_000,
            "gpu_instance": 1,
            "compute_instance": 0,
            "mig_uuid": three_g["uuid"],
        }
    ]
    assert last["mig_devices"] == [
        {"gpu_instance": 1, "compute_instance": 0, "uuid": three_g["uuid"]}
    ]


def test_a_mig_device_uuid_finds_its_parent_gpu() -> None:
    # pod-resources and CUDA_VISIBLE_DEVICES name MIG devices by their own UUID
    parent = Gpu(index=0, uuid="GPU-1abb", pci_bus_id="0000:00:06.0", mig=("MIG-0b5e", "MIG-77aa"))
    inventory = GpuInventory((parent, Gpu(index=1, uuid="GPU-2bcc", pci_bus_id="0000:00:07.0")))
    assert inventory.find("MIG-77aa") is parent
    assert inventory.find("GPU-2bcc") is not None and inventory.find("MIG-none") is None
    assert inventory.find("") is None


MIG_INSTANCES = MIG.with_name("h100-mig-instances-record.json")


def test_mig_capture_with_instances_replays_per_instance_series() -> None:
    # recorded on an H100 test machine with a 3g.40gb and two 1g.10gb instances
    # (`nvidia-smi mig -i 0 -cgi 9,19,19 -C`) while one process held 256 MiB on the 3g.40gb
    source = NvmlSource(ReplayClient.load(MIG_INSTANCES), call_timeout=2.0)
    try:
        for _ in range(3):
            samples = [s for s in source.poll(0.0) if isinstance(s, Sample)]
    finally:
        source.close()

    def get(name: str, **labels: str) -> float | None:
        for s in samples:
            if s.name == name and all(s.label(k) == v for k, v in labels.items()):
                return s.value
        return None

    assert get("gpuwatchd_gpu_mig_devices") == 3
    profiles = {
        (s.label("gpu_instance"), s.label("compute_instance")): s.label("profile")
        for s in samples
        if s.name == "gpuwatchd_mig_device_info"
    }
    assert profiles == {("2", "0"): "3g.40gb", ("7", "0"): "1g.10gb", ("8", "0"): "1g.10gb"}
    info = [s for s in samples if s.name == "gpuwatchd_mig_device_info"]
    assert {s.label("uuid") for s in info} == {"GPU-25f978ca-273b-e097-8313-a182db86ba4c"}
    assert get("gpuwatchd_mig_memory_used_bytes", gpu_instance="2") == 582_877_184
    assert get("gpuwatchd_mig_multiprocessors", gpu_instance="7") == 16
    assert get("gpuwatchd_mig_compute_processes", gpu_instance="2") == 1
    assert get("gpuwatchd_mig_compute_processes", gpu_instance="8") == 0
    # the four free slots answer NOT_FOUND: an answer, not an NVML error
    assert get("gpuwatchd_nvml_errors_total", reason="not_found") is None


def test_real_xid_from_a_mig_instance_names_the_parent_gpu_and_pid() -> None:
    # On this driver an MMU fault inside a MIG instance is logged without GPU-I/GPU-CI:
    # the instance comes from the pid (NVML lists it under its MIG device), not the line.
    path = Path(__file__).resolve().parents[1] / "fixtures" / "kmsg" / "kmsg-h100-mig-xid31.txt"
    records = [parse_line(line) for line in path.read_text().splitlines()]
    xids = [r for r in records if r is not None and r.kind == XID]
    assert len(xids) == 1
    rec = xids[0]
    assert (rec.code, rec.pci_bus_id, rec.pid, rec.process) == (31, "0000:00:06.0", 486, "python3")
    assert rec.extra("gpu_instance") == "" and rec.extra("compute_instance") == ""
