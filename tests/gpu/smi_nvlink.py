"""nvidia-smi's NVLink and utilisation outputs, parsed, and the compare rows built from them.

Used by compare_nvidia_smi.py and nvlink_bandwidth.py; the parsers are tested
without a GPU against real outputs (tests/sources/test_smi_nvlink.py).

- `nvidia-smi nvlink -s`: "Link 0: 26.562 GB/s" or "Link 0: <inactive>";
- `nvidia-smi nvlink -e`: "Link 0: Replay Errors: 0" (Recovery Errors, CRC Errors);
- `nvidia-smi nvlink -gt d` / `-gt r`: "Link 0: Data Tx: 5863784 KiB" (Raw Tx/Rx);
- `nvidia-smi dmon -c 1 -s u`: a "# gpu sm mem ..." header, then one row per GPU.

Each per-GPU block starts "GPU 0: NVIDIA H200 (UUID: GPU-...)"; blocks are
keyed by UUID, which gpuwatchd's series carry too.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any

from gpuwatchd.model import Sample

__all__ = [
    "ERROR_NAMES",
    "nvlink_rows",
    "parse_dmon",
    "parse_link_blocks",
    "parse_nvlink_errors",
    "parse_nvlink_status",
    "parse_nvlink_throughput",
    "parse_topo",
    "run_smi",
    "throughput_rates",
    "topology_rows",
    "utilization_rows",
]

_GPU = re.compile(r"^GPU (\d+): .*\(UUID: (GPU-[0-9a-fA-F-]+)\)")
_LINK = re.compile(r"^\s*Link (\d+): (.*)$")
# nvidia-smi nvlink -e labels -> gpuwatchd_nvlink_errors_total{error}
ERROR_NAMES = {"Replay Errors": "replay", "Recovery Errors": "recovery", "CRC Errors": "crc"}
_UNITS = {"KiB": 1024.0, "MiB": 1024.0**2, "GiB": 1024.0**3, "B": 1.0}


def run_smi(smi: str, *args: str, timeout: float = 60.0) -> str:
    """stdout of one nvidia-smi run ("" if it failed or timed out: a row then says n/a)."""
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def parse_link_blocks(text: str) -> dict[str, dict[int, list[str]]]:
    """{uuid: {link: [the text after "Link N: ", one per line]}}."""
    out: dict[str, dict[int, list[str]]] = {}
    links: dict[int, list[str]] | None = None
    for line in text.splitlines():
        gpu = _GPU.match(line)
        if gpu:
            links = out.setdefault(gpu.group(2), {})
            continue
        link = _LINK.match(line)
        if link and links is not None:
            links.setdefault(int(link.group(1)), []).append(link.group(2).strip())
    return out


def parse_nvlink_status(text: str) -> dict[str, dict[int, float | None]]:
    """`nvlink -s`: {uuid: {link: speed in bytes/s, None when inactive}}."""
    out: dict[str, dict[int, float | None]] = {}
    for uuid, links in parse_link_blocks(text).items():
        for link, values in links.items():
            m = re.match(r"([0-9.]+) GB/s", values[0])
            out.setdefault(uuid, {})[link] = float(m.group(1)) * 1e9 if m else None
    return out


def _labelled(values: Iterable[str]) -> dict[str, str]:
    pairs = {}
    for value in values:
        label, sep, rest = value.partition(":")
        if sep:
            pairs[label.strip()] = rest.strip()
    return pairs


def parse_nvlink_errors(text: str) -> dict[str, dict[int, dict[str, float]]]:
    """`nvlink -e`: {uuid: {link: {replay|recovery|crc (other labels as printed): count}}}."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for uuid, links in parse_link_blocks(text).items():
        for link, values in links.items():
            counts = {}
            for label, rest in _labelled(values).items():
                m = re.match(r"(\d+)", rest)
                if m:
                    counts[ERROR_NAMES.get(label, label)] = float(m.group(1))
            out.setdefault(uuid, {})[link] = counts
    return out


def parse_nvlink_throughput(text: str) -> dict[str, dict[int, dict[str, float]]]:
    """`nvlink -gt d|r`: {uuid: {link: {"data_tx"|"data_rx"|"raw_tx"|"raw_rx": bytes}}}."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for uuid, links in parse_link_blocks(text).items():
        for link, values in links.items():
            counts = {}
            for label, rest in _labelled(values).items():
                m = re.match(r"(\d+)\s*(KiB|MiB|GiB|B)\b", rest)
                if m:
                    key = label.lower().replace(" ", "_")
                    counts[key] = float(m.group(1)) * _UNITS[m.group(2)]
            out.setdefault(uuid, {})[link] = counts
    return out


def throughput_rates(
    before: Mapping[str, Mapping[int, Mapping[str, float]]],
    after: Mapping[str, Mapping[int, Mapping[str, float]]],
    seconds: float,
) -> dict[str, dict[str, float]]:
    """{uuid: {"data_tx": bytes/s summed over links, ...}} between two `-gt` reads."""
    out: dict[str, dict[str, float]] = {}
    for uuid, links in after.items():
        sums: dict[str, float] = {}
        for link, counts in links.items():
            for key, value in counts.items():
                old = before.get(uuid, {}).get(link, {}).get(key)
                if old is not None and value >= old and seconds > 0:
                    sums[key] = sums.get(key, 0.0) + (value - old) / seconds
        out[uuid] = sums
    return out


def parse_dmon(text: str) -> dict[int, dict[str, float]]:
    """`nvidia-smi dmon -c 1`: {gpu index: {column: value}} ("-" columns left out)."""
    header: list[str] = []
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            if not header:
                header = line.lstrip("#").split()
            continue
        cells = line.split()
        if not header or len(cells) != len(header) or not cells[0].isdigit():
            continue
        row = {}
        for name, cell in zip(header[1:], cells[1:], strict=True):
            try:
                row[name] = float(cell)
            except ValueError:
                pass
        out[int(cells[0])] = row
    return out


def parse_topo(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m`: {"GPU0": {"GPU1": "NV18", "NIC0": "PIX", "CPU Affinity": "0-31",
    "NUMA Affinity": "0", ...}}; NIC columns renamed to their device ("mlx5_0") from the legend."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()]
    if not lines:
        return {}
    header = [h.strip() for h in lines[0].split("\t") if h.strip()]
    devices = [h for h in header if re.fullmatch(r"(GPU|NIC)\d+", h)]
    others = [h for h in header if h not in devices]
    nics = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", text, re.MULTILINE))
    out: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.split("\t")]
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        rels = cells[1 : 1 + len(devices)]
        rest = [c for c in cells[1 + len(devices) :] if c]
        row = {nics.get(d, d): r for d, r in zip(devices, rels, strict=False)}
        row.update(zip(others, rest, strict=False))
        out[cells[0]] = row
    return out


def _value(samples: Iterable[Sample], name: str, uuid: str, **labels: str) -> float | None:
    for s in samples:
        lab = dict(s.labels)
        if (
            s.name == name
            and lab.get("uuid") == uuid
            and all(lab.get(k) == v for k, v in labels.items())
        ):
            return s.value
    return None


def _absent(ours: object, theirs: object) -> str:
    """The verdict when a side has no value ("" when both have one)."""
    if ours is None and theirs is None:
        return "both n/a"
    if ours is None:
        return "missing in gpuwatchd"
    return "n/a in nvidia-smi" if theirs is None else ""


def judge(ours: float | None, theirs: float | None, allowed: float) -> str:
    """One value of gpuwatchd against nvidia-smi's: the verdict of a comparison row."""
    if ours is None or theirs is None:
        return _absent(ours, theirs)
    return "agree" if abs(ours - theirs) <= allowed + 1e-9 else "MISMATCH"


def _row(
    bus: str,
    metric: str,
    ours: float | None,
    said: str,
    text: str | None,
    theirs: float | None,
    allowed: float,
) -> dict[str, Any]:
    verdict = judge(ours, theirs, allowed)
    return {
        "gpu": bus,
        "metric": metric,
        "gpuwatchd": ours,
        "nvidia_smi": said,
        "nvidia_smi_text": text,
        "nvidia_smi_value": theirs,
        "verdict": verdict,
    }


def nvlink_rows(
    samples: list[Sample],
    status: str,
    errors: str,
) -> list[dict[str, Any]]:
    """Every per-link NVLink series of gpuwatchd against `nvlink -s` and `-e`
    (GPM throughput: smi_load.throughput_rows)."""
    speeds = parse_nvlink_status(status)
    counts = parse_nvlink_errors(errors)
    buses = {
        dict(s.labels).get("uuid", ""): dict(s.labels).get("pci_bus_id", "").upper()
        for s in samples
    }
    out: list[dict[str, Any]] = []
    for uuid, bus in sorted(buses.items(), key=lambda kv: kv[1]):
        if not uuid:
            continue
        links = sorted(
            {
                int(dict(s.labels)["link"])
                for s in samples
                if s.name.startswith("gpuwatchd_nvlink_")
                and dict(s.labels).get("uuid") == uuid
                and "link" in dict(s.labels)
            }
            | set(speeds.get(uuid, {}))
            | set(counts.get(uuid, {}))
        )
        for link in links:
            ln = str(link)
            speed = speeds.get(uuid, {}).get(link)
            known = link in speeds.get(uuid, {})
            up = _value(samples, "gpuwatchd_nvlink_up", uuid, link=ln)
            out.append(
                _row(
                    bus,
                    f'gpuwatchd_nvlink_up{{link="{ln}"}}',
                    up,
                    "nvlink -s",
                    None
                    if not known
                    else ("inactive" if speed is None else f"{speed / 1e9:g} GB/s"),
                    None if not known else (0.0 if speed is None else 1.0),
                    0,
                )
            )
            ours = _value(samples, "gpuwatchd_nvlink_speed_bytes_per_second", uuid, link=ln)
            # nvidia-smi prints 3 decimals of GB/s
            out.append(
                _row(
                    bus,
                    f'gpuwatchd_nvlink_speed_bytes_per_second{{link="{ln}"}}',
                    ours,
                    "nvlink -s",
                    None if speed is None else f"{speed / 1e9:g} GB/s",
                    speed,
                    0.5e6,
                )
            )
            theirs_all = counts.get(uuid, {}).get(link, {})
            for error in ERROR_NAMES.values():
                theirs = theirs_all.get(error)
                ours = _value(samples, "gpuwatchd_nvlink_errors_total", uuid, link=ln, error=error)
                out.append(
                    _row(
                        bus,
                        f'gpuwatchd_nvlink_errors_total{{link="{ln}",error="{error}"}}',
                        ours,
                        "nvlink -e",
                        None if theirs is None else f"{theirs:g}",
                        theirs,
                        0,
                    )
                )
            for error in ("crc_flit", "crc_data", "ecc_data"):
                ours = _value(
                    samples, "gpuwatchd_nvlink_corrected_errors_total", uuid, link=ln, error=error
                )
                row = _row(
                    bus,
                    f'gpuwatchd_nvlink_corrected_errors_total{{link="{ln}",error="{error}"}}',
                    ours,
                    "",
                    None,
                    None,
                    0,
                )
                row["verdict"] = "no counterpart"
                out.append(row)
    return out


def utilization_rows(
    samples: list[Sample],
    nvml: Mapping[str, float | None],
    query: Mapping[str, Mapping[str, str]],
    dmon: Mapping[int, Mapping[str, float]],
) -> list[dict[str, Any]]:
    """gpuwatchd_gpu_utilization_ratio beside nvmlDeviceGetUtilizationRates, --query-gpu and dmon.

    `nvml` is {uuid: ratio} read by the script itself at the same instant;
    rows say `agree` when all readings are within 0.1 of gpuwatchd's.
    """
    out = []
    for s in samples:
        lab = dict(s.labels)
        if s.name != "gpuwatchd_gpu_utilization_ratio" or lab.get("engine") != "gpu":
            continue
        uuid, bus = lab.get("uuid", ""), lab.get("pci_bus_id", "").upper()
        q = query.get(bus, {}).get("utilization.gpu")
        index = lab.get("gpu", "")
        sm = dmon.get(int(index), {}).get("sm") if index.isdigit() else None
        direct = nvml.get(uuid)
        readings = {
            "nvmlDeviceGetUtilizationRates": direct,
            "query utilization.gpu": None
            if q is None or not q.strip()[:1].isdigit()
            else float(q.split()[0]) / 100,
            "dmon sm": None if sm is None else sm / 100,
        }
        sm_active = _value(samples, "gpuwatchd_gpu_sm_active_ratio", uuid)
        text = ", ".join(
            f"{k} {v:.2f}" if v is not None else f"{k} n/a" for k, v in readings.items()
        )
        if sm_active is not None:
            text += f" (GPM SM active {sm_active:.2f})"
        known = [v for v in readings.values() if v is not None]
        worst = max(known, key=lambda v: abs(v - s.value)) if known else None
        row = _row(
            bus,
            'gpuwatchd_gpu_utilization_ratio{engine="gpu"} (side by side)',
            s.value,
            "NVML / query / dmon",
            text,
            worst,
            0.1,
        )
        row["readings"] = readings  # numbers for smi_load.summarize_rounds
        out.append(row)
    return out


def topology_rows(topology: Mapping[str, Any] | None, topo: str) -> list[dict[str, Any]]:
    """The daemon's topology (/status JSON) against `nvidia-smi topo -m`, pair by pair."""
    if not topology:
        return []
    theirs = parse_topo(topo)
    buses = {f"GPU{g['gpu']}": str(g["pci_bus_id"]).upper() for g in topology.get("gpus", [])}
    out = []
    for gpu, row in sorted(topology.get("matrix", {}).items()):
        said = theirs.get(gpu, {})
        for other, rel in sorted(row.items()):
            if other == gpu:
                continue
            text = said.get(other)
            r = _row(buses.get(gpu, gpu), f"topology {gpu}-{other}", None, "topo -m", text, None, 0)
            r["gpuwatchd_text"] = rel
            r["verdict"] = _text_verdict(None if rel == "unknown" else rel, text)
            out.append(r)
    for g in topology.get("gpus", []):
        said = theirs.get(f"GPU{g['gpu']}", {})
        bus = str(g["pci_bus_id"]).upper()
        for key, ours in (
            ("CPU Affinity", g.get("cpu_affinity")),
            ("NUMA Affinity", g.get("numa_node")),
        ):
            text = said.get(key)
            r = _row(bus, f"topology GPU{g['gpu']} {key}", None, "topo -m", text, None, 0)
            r["gpuwatchd_text"] = None if ours is None else str(ours)
            r["verdict"] = _text_verdict(r["gpuwatchd_text"], text)
            out.append(r)
    return out


def _text_verdict(ours: str | None, theirs: str | None) -> str:
    if ours is None or theirs is None:
        return _absent(ours, theirs)
    return "agree" if ours == theirs else "MISMATCH"
