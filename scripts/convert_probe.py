#!/usr/bin/env python3
"""Convert the 2026-11-21 H200 NVML probe into gpuwatchd's capture format.

    python scripts/convert_probe.py [tests/fixtures/nvml]

reads tests/fixtures/nvml/source/h200x2-nvml-probe.json (the probe's own
format: one ok/value or NVML error per call) and writes h200x2-probe.json
(the same answers under the call names NvmlSource uses) and
h200x8-from-h200x2.json (the same, widened to 8 GPUs by
gpuwatchd.sources.nvml.replay.expand_devices). Probe entries the source never
asks for are left out; calls the probe never made stay absent, so the
replay answers them NOT_RECORDED. See tests/fixtures/nvml/PROVENANCE.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatchd.sources.nvml.client import code_name  # noqa: E402
from gpuwatchd.sources.nvml.replay import FORMAT, expand_devices  # noqa: E402

PROBE = "source/h200x2-nvml-probe.json"

# probe key -> call key in the capture format
DEVICE_KEYS = {
    "name": "name",
    "uuid": "uuid",
    "serial": "serial",
    "pci": "pci_info",
    "minor": "minor_number",
    "vbios": "vbios_version",
    "temp_gpu": "temperature(0)",
    "temp_thresh_shutdown": "temperature_threshold(0)",
    "temp_thresh_slowdown": "temperature_threshold(1)",
    "temp_thresh_mem_max": "temperature_threshold(2)",
    "temp_thresh_gpu_max": "temperature_threshold(3)",
    "power_mw": "power_usage",
    "power_limit_mw": "enforced_power_limit",
    "energy_mj": "total_energy_consumption",
    "util": "utilization_rates",
    "mem": "memory_info",
    "throttle": "clocks_event_reasons",
    "ecc_mode": "ecc_mode",
    "ecc_vol_sbe": "total_ecc_errors(0,0)",
    "ecc_agg_sbe": "total_ecc_errors(0,1)",
    "ecc_vol_dbe": "total_ecc_errors(1,0)",
    "ecc_agg_dbe": "total_ecc_errors(1,1)",
    "ecc_loc_dram_unc_vol": "memory_error_counter(1,0,2)",
    "ecc_loc_sram_unc_vol": "memory_error_counter(1,0,7)",
    "retired_sbe": "retired_pages(0)",
    "retired_dbe": "retired_pages(1)",
    "retired_pending": "retired_pages_pending_status",
    "remapped_rows": "remapped_rows",
    "row_remap_hist": "row_remapper_histogram",
    "pcie_replay": "pcie_replay_counter",
    "pcie_link_gen": "curr_pcie_link_generation",
    "pcie_link_width": "curr_pcie_link_width",
    "pcie_max_gen": "max_pcie_link_generation",
    "pcie_max_width": "max_pcie_link_width",
    "procs": "compute_running_processes",
    "xid_event_supported": "supported_event_types",
}
SYSTEM_KEYS = {
    "driver": "driver_version",
    "nvml_version": "nvml_version",
    "cuda_driver": "cuda_driver_version",
}
PCI_KEYS = ("busId", "domain", "bus", "device", "pciDeviceId", "pciSubSystemId")


def observation(entry: dict[str, Any]) -> dict[str, Any] | None:
    """One probe answer as a capture observation; None for non-NVML failures."""
    us = entry.get("us")
    if entry.get("ok"):
        return {"value": entry.get("value"), "us": us}
    if "code" in entry:
        code = int(entry["code"])
        return {"error": code_name(code), "code": code, "us": us}
    return None  # a Python error in the probe itself: NVML was never asked


def convert_device(dev: dict[str, Any]) -> dict[str, Any]:
    calls: dict[str, list[dict[str, Any]]] = {}
    for probe_key, key in DEVICE_KEYS.items():
        obs = observation(dev[probe_key]) if probe_key in dev else None
        if obs is None:
            continue
        if key == "pci_info" and "value" in obs:
            obs["value"] = {k: obs["value"][k] for k in PCI_KEYS}
        calls[key] = [obs]
    for link, entry in dev.get("nvlink_states", {}).get("value", []):
        obs = observation(entry)
        if obs is not None:
            calls[f"nvlink_state({link})"] = [obs]
    for counter, entry in dev.get("nvlink_err_l0", {}).get("value", {}).items():
        obs = observation(entry)
        if obs is not None:
            calls[f"nvlink_error_counter(0,{counter})"] = [obs]
    calls["field_values"] = [{"value": None, "us": dev.get("field_values_us")}]
    fields: dict[str, list[dict[str, Any]]] = {}
    for name, fv in sorted(dev.get("field_values", {}).items()):
        if "ret" in fv:
            ret = int(fv["ret"])
            fields[f"{name}@0"] = [{"error": code_name(ret), "code": ret}]
        else:
            fields[f"{name}@{fv.get('scope', 0)}"] = [{"value": fv["v"]}]
    return {"calls": dict(sorted(calls.items())), "fields": fields}


def convert_probe(probe: dict[str, Any]) -> dict[str, Any]:
    """The probe as a gpuwatchd capture (format gpuwatchd-nvml-capture/1)."""
    system: dict[str, list[dict[str, Any]]] = {}
    for probe_key, key in SYSTEM_KEYS.items():
        obs = observation(probe[probe_key])
        if obs is not None:
            system[key] = [obs]
    count = int(probe["count"])
    system["device_count"] = [{"value": count}]
    for i in range(count):
        system[f"device_handle({i})"] = [{"value": None}]
    return {
        "format": FORMAT,
        "captured_at": "2026-11-21",
        "tool": "scripts/convert_probe.py (from a call-by-call NVML probe; see PROVENANCE.md)",
        "host": {"nvidia_ml_py": "13.610.43", "kernel": None},
        "polls": 1,
        "note": probe.get("note", ""),
        "init": [{"value": None, "us": round(float(probe["init_ms"]) * 1000, 1)}],
        "system": system,
        "devices": [convert_device(d) for d in probe["devices"]],
    }


def dump(data: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "tests" / "fixtures" / "nvml"
    probe = json.loads((out / PROBE).read_text(encoding="utf-8"))
    capture = convert_probe(probe)
    dump(capture, out / "h200x2-probe.json")
    dump(expand_devices(capture, 8), out / "h200x8-from-h200x2.json")
    print(f"wrote {out / 'h200x2-probe.json'} and {out / 'h200x8-from-h200x2.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
