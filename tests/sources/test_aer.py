"""AerSource over the sysfs fixture tree (tests/fixtures/sys, AER files from public sources)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from gpuwatchd.config import load_text
from gpuwatchd.errors import SourceError
from gpuwatchd.model import Event, Gpu, GpuInventory, Sample
from gpuwatchd.sources import SourceContext, registry
from gpuwatchd.sources.aer.source import UNAVAILABLE_NO_DEVICES, UNAVAILABLE_NO_FILES, AerSource
from gpuwatchd.sources.aer.sysfs import discover, parse_dev_file, parse_total

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sys"
P = "gpuwatchd_pcie_aer_"
GPUS = GpuInventory(
    (
        Gpu(index=0, uuid="GPU-a", pci_bus_id="0000:19:00.0"),
        Gpu(index=1, uuid="GPU-b", pci_bus_id="0000:1b:00.0"),
        Gpu(index=2, uuid="GPU-c", pci_bus_id="0000:3b:00.0"),
        Gpu(index=3, uuid="GPU-d", pci_bus_id="0000:9d:00.0"),
    )
)
# Paths of the fixture's functions, below devices/
GPU0 = "pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0/0000:19:00.0"
SWITCH_UP = "pci0000:16/0000:16:01.0/0000:17:00.0"


def family(items: list[Sample | Event], name: str) -> dict[tuple[str, ...], float]:
    """Label values (in label-name order) -> value for one metric family."""
    return {
        tuple(v for _, v in s.labels): s.value
        for s in items
        if isinstance(s, Sample) and s.name == name
    }


def copy_tree(tmp_path: Path) -> Path:
    dst = tmp_path / "sys"
    shutil.copytree(FIXTURE, dst, symlinks=True)
    return dst


def set_counts(root: Path, dev: str, fname: str, **counts: int) -> None:
    """Rewrite some lines of an aer_dev_* file, keeping the kernel's format and order."""
    path = root / "devices" / dev / fname
    lines = []
    for line in path.read_text().splitlines():
        name, _, value = line.rpartition(" ")
        lines.append(f"{name} {counts.get(name, value)}")
    path.write_text("\n".join(lines) + "\n")


# --- parsing -------------------------------------------------------------------------


def test_parse_short_names_of_current_kernels() -> None:
    got = parse_dev_file((FIXTURE / "devices" / GPU0 / "aer_dev_fatal").read_text())
    assert got is not None and got.total == 0
    assert list(got.by_error)[:3] == ["Undefined", "DLP", "SDES"]
    assert len(got.by_error) == 18 and "PoisonTLPBlocked" in got.by_error


def test_parse_long_names_with_spaces_of_kernel_4_19() -> None:
    text = (FIXTURE / "devices" / "pci0000:9a" / "0000:9a:01.0" / "aer_dev_correctable").read_text()
    got = parse_dev_file(text)
    assert got is not None
    assert got.total == 2
    assert got.by_error["Receiver Error"] == 2
    assert got.by_error["RELAY_NUM Rollover"] == 0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "RxErr 1\n",
        "RxErr x\nTOTAL_ERR_COR 1\n",
        "TOTAL_ERR_COR\n",
        "RxErr -1\nTOTAL_ERR_COR 0\n",
    ],
)
def test_parse_rejects_files_without_a_total_or_with_junk(text: str) -> None:
    assert parse_dev_file(text) is None


def test_parse_rootport_total() -> None:
    assert parse_total("2\n") == 2
    assert parse_total("") is None and parse_total("n/a") is None


# --- what is watched ------------------------------------------------------------------


def test_discovery_finds_gpus_nics_and_every_bridge_up_to_the_root_port() -> None:
    known = {g.pci_bus_id: str(g.index) for g in GPUS}
    devices = {d.bus_id: d for d in discover(str(FIXTURE), known)}
    roles = {bus: d.role for bus, d in devices.items()}
    assert roles["0000:19:00.0"] == "gpu" and roles["0000:1a:00.0"] == "nic"
    assert roles["0000:16:01.0"] == "root_port"
    assert roles["0000:17:00.0"] == roles["0000:18:00.0"] == "bridge"
    up = devices["0000:17:00.0"]  # the switch's upstream port serves two GPUs and a NIC
    assert up.gpus == ("0", "1") and up.nics == ("mlx5_0",) and up.root_port == "0000:16:01.0"
    assert devices["0000:18:00.0"].gpus == ("0",) and devices["0000:18:00.0"].nics == ()
    # every function of the tree, each once: 4 GPUs, 4 NICs, their bridges and root ports
    assert sum(r == "gpu" for r in roles.values()) == 4
    assert sum(r == "nic" for r in roles.values()) == 4
    assert sum(r == "root_port" for r in roles.values()) == 5
    assert len(devices) == 22


def test_gpus_are_found_in_sysfs_without_nvml() -> None:
    devices = {d.bus_id: d for d in discover(str(FIXTURE), {})}
    assert devices["0000:19:00.0"].role == "gpu"
    assert devices["0000:17:00.0"].gpus == ("0000:19:00.0", "0000:1b:00.0")


# --- polls ----------------------------------------------------------------------------


def test_counters_per_function_role_and_severity() -> None:
    out = AerSource(str(FIXTURE), gpus=lambda: GPUS).poll(0.0)
    totals = family(out, P + "errors_total")
    assert totals[("0000:19:00.0", "gpu", "fatal")] == 0
    assert totals[("0000:9a:01.0", "root_port", "correctable")] == 2
    assert len(totals) == 21 * 3  # i40iw0 has no AER capability
    assert ("0000:3e:00.0", "nic", "fatal") not in totals
    rootport = family(out, P + "rootport_errors_total")
    assert rootport[("0000:9a:01.0", "correctable")] == 2
    assert len(rootport) == 5 * 3
    assert family(out, P + "available") == {(): 1.0}
    info = family(out, P + "device_info")
    assert info[("0,1", "mlx5_0", "0000:17:00.0", "bridge", "0000:16:01.0")] == 1


def test_error_types_only_once_they_have_counted(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = AerSource(str(root), gpus=lambda: GPUS)
    types = family(src.poll(0.0), P + "error_types_total")
    assert types == {("Receiver Error", "0000:9a:01.0", "root_port", "correctable"): 2}
    set_counts(root, GPU0, "aer_dev_fatal", SDES=1, TOTAL_ERR_FATAL=1)
    types = family(src.poll(30.0), P + "error_types_total")
    assert types[("SDES", "0000:19:00.0", "gpu", "fatal")] == 1
    set_counts(root, GPU0, "aer_dev_fatal", SDES=0, TOTAL_ERR_FATAL=0)  # re-enumerated
    types = family(src.poll(60.0), P + "error_types_total")
    assert types[("SDES", "0000:19:00.0", "gpu", "fatal")] == 0  # kept: a reset, not a gap


def strip_aer(root: Path) -> None:
    for dirpath, _, files in os.walk(root / "devices"):
        for f in files:
            if f.startswith("aer_"):
                os.remove(os.path.join(dirpath, f))


def test_no_aer_files_is_said_once_with_a_gauge_and_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_tree(tmp_path)
    strip_aer(root)  # a VM: the same functions, no AER capability exposed
    src = AerSource(str(root), gpus=lambda: GPUS)
    with caplog.at_level(logging.INFO, logger="gpuwatchd.aer"):
        for t in range(5):
            out = src.poll(30.0 * t)
    assert family(out, P + "available") == {(): 0.0}
    assert not family(out, P + "errors_total") and not family(out, P + "read_errors_total")
    said = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert src.status()["available"] is False
    assert src.status()["reason"] == UNAVAILABLE_NO_FILES


def test_no_pci_tree_at_all_is_unavailable_not_an_error(tmp_path: Path) -> None:
    src = AerSource(str(tmp_path))
    assert family(list(src.poll(0.0)), P + "available") == {(): 0.0}
    assert src.status()["reason"] == UNAVAILABLE_NO_DEVICES


def test_unreadable_pci_tree_is_a_source_error(tmp_path: Path) -> None:
    (tmp_path / "bus").mkdir()
    (tmp_path / "bus" / "pci").write_text("")  # not a directory
    with pytest.raises(SourceError):
        AerSource(str(tmp_path)).poll(0.0)


def test_unparsable_file_is_counted_and_the_rest_exported(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    (root / "devices" / GPU0 / "aer_dev_nonfatal").write_text("garbage\n")
    out = AerSource(str(root), gpus=lambda: GPUS).poll(0.0)
    assert family(out, P + "read_errors_total") == {("unparsable",): 1}
    totals = family(out, P + "errors_total")
    assert ("0000:19:00.0", "gpu", "nonfatal") not in totals
    assert totals[("0000:19:00.0", "gpu", "fatal")] == 0


def test_a_gpu_that_leaves_the_bus_drops_out_at_the_next_poll(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    src = AerSource(str(root), gpus=lambda: GPUS)
    assert ("0000:19:00.0", "gpu", "fatal") in family(src.poll(0.0), P + "errors_total")
    (root / "bus" / "pci" / "devices" / "0000:19:00.0").unlink()
    shutil.rmtree(root / "devices" / GPU0)
    out = src.poll(30.0)
    assert ("0000:19:00.0", "gpu", "fatal") not in family(out, P + "errors_total")
    assert family(out, P + "available") == {(): 1.0}


def test_registered_enabled_by_default_and_built_from_config() -> None:
    spec = registry()["aer"]
    assert spec.default_enabled
    cfg = load_text(f"paths: {{sysfs: {FIXTURE}}}\nsources: {{aer: {{interval: 45}}}}\n")
    src = spec.factory(cfg, SourceContext(gpus=lambda: GPUS))
    assert isinstance(src, AerSource) and src.interval == 45
    assert family(list(src.poll(0.0)), P + "available") == {(): 1.0}
