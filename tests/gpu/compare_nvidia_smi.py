"""Compare every NVML-derived gpuwatchd metric with nvidia-smi on the same GPUs.

Run as root on a GPU machine (not part of the test suite):

    python tests/gpu/compare_nvidia_smi.py --json OUT.json --markdown OUT.md

The NVML source is polled twice, a second apart (so GPM has an interval);
the second poll starts together with `nvidia-smi --query-gpu` and
`nvidia-smi -q`, so both read the GPU at the same moment. Each row says
whether the two agree within the row's tolerance: exact for identity,
limits and counters, a small margin for live readings (temperature, power,
clocks, utilisation) that move between two reads. Series with no
nvidia-smi counterpart (most of GPM, corrected NVLink errors) are listed as
`no counterpart`.

NVLink rows (smi_nvlink.py): link state and speed against `nvidia-smi
nvlink -s`, replay/recovery/CRC errors against `nvlink -e`. GPM NVLink
throughput (smi_load.py) against the rate of the `nvlink -gt r` counters
(header and payload, as GPM counts), within 10 %; past that the row says
"window differs under varying load" when GPM's window (between the two
polls) and the counters' are not comparable (use --gap 5 or more under
load). Thresholds derived from T.Limit accept 1 C (two rounded readings).
The utilisation row puts gpuwatchd's reading beside
nvmlDeviceGetUtilizationRates (read by this script), `--query-gpu=utilization.gpu`
and `nvidia-smi dmon`, all at once; `--util-rounds N` repeats that N times,
and the rounds judge utilisation: the collector must equal nvidia-smi in most
of them (a single instant under a swinging load then says "varies under load").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpuwatchd.model import Sample  # noqa: E402
from gpuwatchd.pci import normalize_bus_id  # noqa: E402
from gpuwatchd.sources.nvml.client import NvmlClient, Pynvml  # noqa: E402
from gpuwatchd.sources.nvml.source import NvmlSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smi_load import (  # noqa: E402
    rounds_rows,
    soften_single_instant,
    summarize_rounds,
    throughput_rows,
)
from smi_nvlink import (  # noqa: E402
    nvlink_rows,
    parse_dmon,
    parse_nvlink_throughput,
    run_smi,
    throughput_rates,
    topology_rows,
    utilization_rows,
)

MIB = 1024 * 1024
# a tlimit: threshold is current temperature + margin, two whole-degree readings
TLIMIT_TOLERANCE = 1.0


def _num(text: str) -> float | None:
    m = re.match(r"\s*(-?[0-9.]+)", text)
    return float(m.group(1)) if m else None


def _flag(text: str) -> float | None:
    t = text.strip().lower()
    if t in ("enabled", "active", "yes", "1"):
        return 1.0
    if t in ("disabled", "not active", "no", "0"):
        return 0.0
    return None


def _pstate(text: str) -> float | None:
    m = re.match(r"\s*P(\d+)", text)
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class Row:
    """One metric of gpuwatchd against one nvidia-smi value."""

    family: str
    labels: Mapping[str, str]
    source: str  # "query:FIELD" or "q:Section/Key"
    convert: Callable[[str], float | None]
    scale: float = 1.0
    tolerance: float = 0.0  # absolute, in the metric's unit
    relative: float = 0.0  # fraction of the nvidia-smi value


def _rows() -> list[Row]:
    rows = [
        Row(
            "gpuwatchd_gpu_temperature_celsius",
            {"sensor": "gpu"},
            "query:temperature.gpu",
            _num,
            tolerance=2,
        ),
        Row(
            "gpuwatchd_gpu_temperature_celsius",
            {"sensor": "memory"},
            "query:temperature.memory",
            _num,
            tolerance=2,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "shutdown"},
            "q:Temperature/GPU Shutdown Temp | tlimit:GPU Shutdown T.Limit Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "slowdown"},
            "q:Temperature/GPU Slowdown Temp | tlimit:GPU Slowdown T.Limit Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "gpu_max"},
            "q:Temperature/GPU Max Operating Temp | tlimit:GPU Max Operating T.Limit Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_temperature_threshold_celsius",
            {"threshold": "memory_max"},
            "q:Temperature/Memory Max Operating Temp",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_power_watts",
            {},
            "query:power.draw.instant",
            _num,
            tolerance=15,
            relative=0.1,
        ),
        Row(
            "gpuwatchd_gpu_power_limit_watts", {}, "query:enforced.power.limit", _num, tolerance=0.5
        ),
        Row(
            "gpuwatchd_gpu_utilization_ratio",
            {"engine": "gpu"},
            "query:utilization.gpu",
            _num,
            scale=0.01,
            tolerance=0.1,
        ),
        Row(
            "gpuwatchd_gpu_utilization_ratio",
            {"engine": "memory"},
            "query:utilization.memory",
            _num,
            scale=0.01,
            tolerance=0.1,
        ),
        Row(
            "gpuwatchd_gpu_memory_capacity_bytes",
            {},
            "query:memory.total",
            _num,
            scale=MIB,
            tolerance=MIB,
        ),
        Row(
            "gpuwatchd_gpu_memory_reserved_bytes",
            {},
            "query:memory.reserved",
            _num,
            scale=MIB,
            tolerance=MIB,
        ),
        Row(
            "gpuwatchd_gpu_memory_used_bytes",
            {},
            "query:memory.used",
            _num,
            scale=MIB,
            tolerance=4 * MIB,
        ),
        Row(
            "gpuwatchd_gpu_memory_free_bytes",
            {},
            "query:memory.free",
            _num,
            scale=MIB,
            tolerance=4 * MIB,
        ),
        Row("gpuwatchd_gpu_performance_state", {}, "query:pstate", _pstate),
        Row(
            "gpuwatchd_gpu_pcie_link_generation",
            {"which": "current"},
            "query:pcie.link.gen.current",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_pcie_link_generation", {"which": "max"}, "query:pcie.link.gen.max", _num
        ),
        Row(
            "gpuwatchd_gpu_pcie_link_width",
            {"which": "current"},
            "query:pcie.link.width.current",
            _num,
        ),
        Row("gpuwatchd_gpu_pcie_link_width", {"which": "max"}, "query:pcie.link.width.max", _num),
        Row("gpuwatchd_gpu_ecc_enabled", {"which": "current"}, "query:ecc.mode.current", _flag),
        Row("gpuwatchd_gpu_ecc_enabled", {"which": "pending"}, "query:ecc.mode.pending", _flag),
        Row(
            "gpuwatchd_gpu_remapped_rows_total",
            {"cause": "correctable"},
            "query:remapped_rows.correctable",
            _num,
        ),
        Row(
            "gpuwatchd_gpu_remapped_rows_total",
            {"cause": "uncorrectable"},
            "query:remapped_rows.uncorrectable",
            _num,
        ),
        Row("gpuwatchd_gpu_row_remap_pending", {}, "query:remapped_rows.pending", _flag),
        Row("gpuwatchd_gpu_row_remap_failure", {}, "query:remapped_rows.failure", _flag),
        Row("gpuwatchd_gpu_mig_mode", {"which": "current"}, "query:mig.mode.current", _flag),
        Row("gpuwatchd_gpu_mig_mode", {"which": "pending"}, "query:mig.mode.pending", _flag),
    ]
    for err in ("corrected", "uncorrected"):
        for scope in ("volatile", "aggregate"):
            rows.append(
                Row(
                    "gpuwatchd_gpu_ecc_errors_total",
                    {"error": err, "scope": scope},
                    f"query:ecc.errors.{err}.{scope}.total",
                    _num,
                )
            )
    for clock, field, q_name in (
        ("graphics", "gr", "Graphics"),
        ("sm", "sm", "SM"),
        ("memory", "mem", "Memory"),
        ("video", "video", "Video"),
    ):
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_hertz",
                {"clock": clock},
                f"query:clocks.{field} | q:Clocks/{q_name}",
                _num,
                scale=1e6,
                relative=0.05,
            )
        )
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_max_hertz",
                {"clock": clock},
                f"q:Max Clocks/{q_name}",
                _num,
                scale=1e6,
            )
        )
    for clock, q_name in (("graphics", "Graphics"), ("memory", "Memory")):
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_application_hertz",
                {"clock": clock},
                f"q:Applications Clocks/{q_name}",
                _num,
                scale=1e6,
            )
        )
    for reason in (
        "gpu_idle",
        "applications_clocks_setting",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    ):
        rows.append(
            Row(
                "gpuwatchd_gpu_clock_event_active",
                {"reason": reason},
                f"query:clocks_event_reasons.{reason}",
                _flag,
            )
        )
    return rows


# -q section names for the clock-event time counters differ between drivers
_COUNTER_SECTIONS = (
    "Clocks Event Reasons Counters",
    "Clocks Event Reasons",
    "Clocks Throttle Reasons",
)
_COUNTER_KEYS = {
    "sw_power_cap": ("SW Power Capping", "SW Power Cap"),
    "sync_boost": ("Sync Boost",),
    "sw_thermal_slowdown": ("SW Thermal Slowdown",),
    "hw_thermal_slowdown": ("HW Thermal Slowdown",),
    "hw_power_brake_slowdown": ("HW Power Braking", "HW Power Brake Slowdown"),
}


def parse_q(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi -q` as {bus id: {"Section/Sub/Key": value}}."""
    gpus: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if line.startswith("GPU ") and ":" in line:
            current = gpus.setdefault(normalize_bus_id(line[4:].strip()).upper(), {})
            stack = []
            continue
        if current is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if ":" in line:
            key, _, value = line.strip().partition(":")
            path = "/".join([s for _, s in stack] + [key.strip()])
            current[path] = value.strip()
            if not value.strip():
                stack.append((indent, key.strip()))
        else:
            stack.append((indent, line.strip()))
    return gpus


def _q_value(q: Mapping[str, str], path: str) -> str | None:
    """A -q value by "Section/Key", wherever the section nests (older drivers differ)."""
    if path in q:
        return q[path]
    section, key = path.rsplit("/", 1)
    for full, value in q.items():
        if full.endswith(f"{section}/{key}") or full.endswith(f"/{key}") and section in full:
            return value
    return None


def query_fields(smi: str) -> list[str]:
    """Field names this nvidia-smi accepts in --query-gpu."""
    out = subprocess.run([smi, "--help-query-gpu"], capture_output=True, text=True, timeout=30)
    names: list[str] = []
    for line in out.stdout.splitlines():
        if line.startswith('"'):  # `"clocks.current.graphics" or "clocks.gr"`
            names += re.findall(r'"([a-z0-9_.]+)"', line)
    return names


def run_query(smi: str, fields: list[str]) -> dict[str, dict[str, str]]:
    """--query-gpu for `fields` (plus pci.bus_id first) as {bus id: {field: text}}."""
    ask = ["pci.bus_id", *fields]
    out = subprocess.run(
        [smi, f"--query-gpu={','.join(ask)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"nvidia-smi --query-gpu failed: {out.stderr or out.stdout}")
    gpus = {}
    for line in out.stdout.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        gpus[normalize_bus_id(values[0]).upper()] = dict(zip(ask, values, strict=False))
    return gpus


def _match(
    samples: Iterable[Sample], family: str, bus: str, labels: Mapping[str, str]
) -> float | None:
    for s in samples:
        lab = dict(s.labels)
        if (
            s.name == family
            and lab.get("pci_bus_id", "").upper() == bus
            and all(lab.get(k) == v for k, v in labels.items())
        ):
            return s.value
    return None


def compare(
    samples: list[Sample],
    query: Mapping[str, Mapping[str, str]],
    q: Mapping[str, Mapping[str, str]],
    accepted: set[str],
) -> list[dict[str, Any]]:
    """One result per (GPU, row), plus the rows of series with no counterpart."""
    results: list[dict[str, Any]] = []
    buses = sorted({dict(s.labels).get("pci_bus_id", "").upper() for s in samples} - {""})
    for bus in buses:
        qgpu = q.get(bus, {})
        rows = _rows()
        for reason, keys in _COUNTER_KEYS.items():
            for section in _COUNTER_SECTIONS:
                hit = next(
                    (k for k in keys if f"{section}/{k}" in qgpu and _unit(qgpu[f"{section}/{k}"])),
                    None,
                )
                if hit:
                    rows.append(
                        Row(
                            "gpuwatchd_gpu_clock_event_seconds_total",
                            {"reason": reason},
                            f"q:{section}/{hit}",
                            _seconds,
                            # the counter grows 1 s/s while the reason holds, and the
                            # two reads are up to ~0.2 s apart
                            tolerance=0.25,
                        )
                    )
                    break
        for row in rows:
            ours = _match(samples, row.family, bus, row.labels)
            text, used = None, row.source
            for source in row.source.split(" | "):
                text = _lookup(source, query.get(bus, {}), qgpu, accepted)
                if text is not None:
                    used = source
                    break
            theirs_raw = None if text is None else row.convert(text)
            theirs = None if theirs_raw is None else theirs_raw * row.scale
            if ours is None and theirs is None:
                verdict = "both n/a"
            elif ours is None:
                verdict = "missing in gpuwatchd"
            elif theirs is None:
                verdict = "n/a in nvidia-smi"
            else:
                allowed = max(row.tolerance, abs(theirs) * row.relative)
                if used.startswith("tlimit:"):
                    # two readings rounded to whole degrees, taken at different instants
                    allowed = max(allowed, TLIMIT_TOLERANCE)
                verdict = "agree" if abs(ours - theirs) <= allowed + 1e-9 else "MISMATCH"
            results.append(
                {
                    "gpu": bus,
                    "metric": row.family + _fmt(row.labels),
                    "gpuwatchd": ours,
                    "nvidia_smi": used,
                    "nvidia_smi_text": text,
                    "nvidia_smi_value": theirs,
                    "verdict": verdict,
                }
            )
        covered = {r.family for r in rows}
        for family in sorted(
            {s.name for s in samples if dict(s.labels).get("pci_bus_id", "").upper() == bus}
            - covered
        ):
            value = _match(samples, family, bus, {})
            results.append(
                {
                    "gpu": bus,
                    "metric": family,
                    "gpuwatchd": value,
                    "nvidia_smi": "",
                    "nvidia_smi_text": None,
                    "nvidia_smi_value": None,
                    "verdict": "no counterpart",
                }
            )
    return results


def _lookup(
    source: str, query: Mapping[str, str], qgpu: Mapping[str, str], accepted: set[str]
) -> str | None:
    """The nvidia-smi text one source names, or None where it has none."""
    where, _, name = source.partition(":")
    if where == "query":
        text = query.get(name) if name in accepted else None
        return None if text is None or "N/A" in text else text
    if where == "tlimit":
        # drivers from 580 print thresholds relative to T.Limit; T.Limit itself is
        # the current temperature plus the "GPU T.Limit Temp" margin
        cur = _num(qgpu.get("Temperature/GPU Current Temp", ""))
        margin = _num(qgpu.get("Temperature/GPU T.Limit Temp", ""))
        rel = _num(qgpu.get(f"Temperature/{name}", ""))
        if cur is None or margin is None or rel is None:
            return None
        limit = cur + margin
        return (
            f"{limit - rel:g} (T.Limit {limit:g} C, {name} {rel:g} C; derived from the "
            f"current temperature and a margin, each rounded: +-{TLIMIT_TOLERANCE:g} C accepted)"
        )
    return _q_value(qgpu, name)


def _unit(text: str) -> bool:
    return bool(re.match(r"\s*[0-9]+\s*(us|ns|ms|s)\b", text))


def _seconds(text: str) -> float | None:
    m = re.match(r"\s*([0-9.]+)\s*(us|ns|ms|s)\b", text)
    if not m:
        return None
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def _fmt(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def markdown(results: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| GPU | gpuwatchd metric | gpuwatchd | nvidia-smi | nvidia-smi says | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ours = "" if r["gpuwatchd"] is None else f"{r['gpuwatchd']:.6g}"
        ours = r.get("gpuwatchd_text") or ours  # topology rows compare text
        said = r["nvidia_smi_text"] or ""
        lines.append(
            f"| {r['gpu']} | `{r['metric']}` | {ours} | {r['nvidia_smi']} | {said} "
            f"| {r['verdict']} |"
        )
    counts: dict[str, int] = {}
    for r in results:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    lines.append("")
    lines.append("Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines) + "\n"


def _nvml_utilization(client: NvmlClient, count: int) -> dict[str, float | None]:
    """{uuid: nvmlDeviceGetUtilizationRates().gpu / 100}, read by this script itself."""
    out: dict[str, float | None] = {}
    for i in range(count):
        try:
            dev = client.device(i)
            util = dev.call("utilization_rates")
            uuid = str(dev.call("uuid"))
        except Exception:  # noqa: BLE001 - a GPU NVML cannot read is n/a in the table
            continue
        value = util.get("gpu") if isinstance(util, dict) else None
        out[uuid] = None if value is None else float(value) / 100
    return out


def _at_once(jobs: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run the jobs in threads started together; each gets at most 90 s."""
    out: dict[str, Any] = {}

    def run(name: str, job: Callable[[], Any]) -> None:
        out[name] = job()

    threads = [threading.Thread(target=run, args=kv, daemon=True) for kv in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    return out


def collect(
    client: NvmlClient, smi: str, gap: float, util_rounds: int = 0
) -> tuple[list[Sample], dict[str, Any], dict[str, Any], set[str], dict[str, Any]]:
    """Poll twice; the second poll and nvidia-smi run at the same moment.

    The NVLink throughput counters (`nvlink -gt d|r`) are read right after
    the first poll and with the second, so their rate covers the interval
    GPM reports. `util_rounds` more polls, a second apart, each read the
    utilisation four ways at once (the JSON's `utilization_rounds`).
    """
    accepted = set(query_fields(smi))
    wanted = sorted(
        {r.source.split(":", 1)[1] for r in _rows() if r.source.startswith("query:")} & accepted
    )
    source = NvmlSource(client, call_timeout=10.0, interval=gap)
    extra: dict[str, Any] = {"utilization_rounds": []}
    try:
        polled_at = [time.monotonic()]
        first = source.poll(time.time())
        count = len(
            {dict(s.labels).get("uuid") for s in first if isinstance(s, Sample)} - {None, ""}
        )
        before = _at_once({"d": _timed(smi, "d"), "r": _timed(smi, "r")})
        time.sleep(gap)
        polled: dict[str, Any] = {}

        def poll() -> None:
            polled_at.append(time.monotonic())
            polled["items"] = source.poll(time.time())
            polled["nvml"] = _nvml_utilization(client, count)

        smi_out = _at_once(
            {
                "poll": poll,
                "query": lambda: run_query(smi, wanted),
                "q": lambda: run_smi(smi, "-q"),
                "d": _timed(smi, "d"),
                "r": _timed(smi, "r"),
                "status": lambda: run_smi(smi, "nvlink", "-s"),
                "errors": lambda: run_smi(smi, "nvlink", "-e"),
                "dmon": lambda: run_smi(smi, "dmon", "-c", "1", "-s", "pu", timeout=30),
                "topo": lambda: run_smi(smi, "topo", "-m"),
            }
        )
        items = polled.get("items", [])
        # each rate over the interval between its own two reads (mid-points of the runs)
        windows = {
            k: smi_out[k][0] - before[k][0] for k in ("d", "r") if k in smi_out and k in before
        }
        extra.update(
            nvml_utilization=polled.get("nvml", {}),
            status=smi_out.get("status", ""),
            errors=smi_out.get("errors", ""),
            dmon=smi_out.get("dmon", ""),
            throughput_before={k: before.get(k, (0.0, ""))[1] for k in ("d", "r")},
            throughput_after={k: smi_out.get(k, (0.0, ""))[1] for k in ("d", "r")},
            throughput_seconds=windows.get("d", 0.0),
            throughput_seconds_by_kind=windows,
            gap=gap,
            gpm_window_seconds=polled_at[-1] - polled_at[0] if len(polled_at) > 1 else gap,
            topo=smi_out.get("topo", ""),
            topology=source.status().get("topology"),
        )
        for _ in range(util_rounds):
            time.sleep(1.0)
            got: dict[str, Any] = {}

            def round_poll(got: dict[str, Any] = got) -> None:
                got["items"] = source.poll(time.time())
                got["nvml"] = _nvml_utilization(client, count)

            r = _at_once(
                {
                    "poll": round_poll,
                    "query": lambda: run_query(smi, ["utilization.gpu"]),
                    "dmon": lambda: run_smi(smi, "dmon", "-c", "1", "-s", "u", timeout=30),
                }
            )
            rows = utilization_rows(
                [s for s in got.get("items", []) if isinstance(s, Sample)],
                got.get("nvml", {}),
                r.get("query", {}),
                parse_dmon(r.get("dmon", "")),
            )
            extra["utilization_rounds"].append({"time": time.time(), "rows": rows})
    finally:
        source.close()
    samples = [s for s in items if isinstance(s, Sample)]
    return samples, smi_out.get("query", {}), parse_q(smi_out.get("q", "")), accepted, extra


def _timed(smi: str, kind: str) -> Callable[[], tuple[float, str]]:
    """A job reading `nvlink -gt KIND`, returning (mid-point in monotonic time, stdout)."""

    def job() -> tuple[float, str]:
        start = time.monotonic()
        out = run_smi(smi, "nvlink", "-gt", kind)
        return (start + time.monotonic()) / 2, out

    return job


def extra_rows(
    samples: list[Sample],
    query: Mapping[str, Mapping[str, str]],
    extra: Mapping[str, Any],
    gap: float = 1.0,
) -> list[dict[str, Any]]:
    """The NVLink, side-by-side and rounds utilisation rows from what collect() saved.

    `gap` stands in for the GPM window where the JSON predates `gpm_window_seconds`.
    """
    if not extra:
        return []
    rates: dict[str, dict[str, float]] = {}
    by_kind = extra.get("throughput_seconds_by_kind", {})
    for kind in ("d", "r"):
        for uuid, sums in throughput_rates(
            parse_nvlink_throughput(extra.get("throughput_before", {}).get(kind, "")),
            parse_nvlink_throughput(extra.get("throughput_after", {}).get(kind, "")),
            float(by_kind.get(kind, extra.get("throughput_seconds", 0.0))),
        ).items():
            rates.setdefault(uuid, {}).update(sums)
    topology = topology_rows(extra.get("topology"), extra.get("topo", ""))
    gpm_seconds = float(extra.get("gpm_window_seconds", extra.get("gap", gap)))
    return (
        topology
        + nvlink_rows(samples, extra.get("status", ""), extra.get("errors", ""))
        + throughput_rows(samples, rates, gpm_seconds, extra.get("throughput_seconds"))
        + utilization_rows(
            samples, extra.get("nvml_utilization", {}), query, parse_dmon(extra.get("dmon", ""))
        )
        + rounds_rows(summarize_rounds(extra.get("utilization_rounds", [])))
    )


_METRIC = re.compile(r"^([a-z_]+)(?:\{(.*)\})?$")


def saved(
    path: Path,
) -> tuple[list[Sample], dict[str, Any], dict[str, Any], set[str], dict[str, Any]]:
    """The gpuwatchd readings and nvidia-smi outputs of an earlier --json run."""
    data = json.loads(path.read_text())
    # the GPU index (dmon's rows) by bus id; older JSON has it in the daemon's topology
    index = data.get("gpu_index") or {
        str(g["pci_bus_id"]).upper(): str(g["gpu"])
        for g in (data.get("nvlink", {}).get("topology") or {}).get("gpus", [])
    }
    samples = []
    for r in data["results"]:
        m = _METRIC.match(r["metric"])
        if m is None or r["gpuwatchd"] is None:
            continue
        labels = dict(re.findall(r'([a-z_]+)="([^"]*)"', m.group(2) or ""))
        uuid = data.get("uuids", {}).get(r["gpu"], "")
        if r["gpu"] in index:
            labels.setdefault("gpu", index[r["gpu"]])
        samples.append(
            Sample.of(m.group(1), r["gpuwatchd"], pci_bus_id=r["gpu"], uuid=uuid, **labels)
        )
    query = data["query"]
    accepted = {k for gpu in query.values() for k in gpu}
    return samples, query, data["q"], accepted, data.get("nvlink", {})


def main(argv: list[str] | None = None) -> int:
    """Poll, compare, print the table; exit 1 when any value disagrees."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi to run")
    parser.add_argument(
        "--gap",
        type=float,
        default=1.0,
        help="seconds between the two polls (with --rejudge: the GPM window of a JSON "
        "that did not save it)",
    )
    parser.add_argument(
        "--util-rounds",
        type=int,
        default=0,
        help="this many more polls, a second apart, reading utilisation four ways at once",
    )
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument(
        "--rejudge",
        type=Path,
        metavar="JSON",
        help="judge the readings saved by an earlier --json run again (no GPU needed)",
    )
    args = parser.parse_args(argv)
    if args.rejudge:
        samples, query, q, accepted, extra = saved(args.rejudge)
    else:
        samples, query, q, accepted, extra = collect(
            Pynvml(), args.nvidia_smi, args.gap, args.util_rounds
        )
    nvlink = extra_rows(samples, query, extra, args.gap)
    covered = {r["metric"].split("{")[0] for r in nvlink}
    results = [
        r
        for r in compare(samples, query, q, accepted)
        if not (r["verdict"] == "no counterpart" and r["metric"] in covered)
    ] + nvlink
    soften_single_instant(results, summarize_rounds(extra.get("utilization_rounds", [])))
    table = markdown(results)
    print(table)
    if args.json:
        uuids = {
            dict(s.labels).get("pci_bus_id", "").upper(): dict(s.labels).get("uuid", "")
            for s in samples
        }
        index = {
            dict(s.labels).get("pci_bus_id", "").upper(): dict(s.labels).get("gpu", "")
            for s in samples
        }
        doc = {
            "results": results,
            "query": query,
            "q": q,
            "nvlink": extra,
            "uuids": uuids,
            "gpu_index": index,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    return 1 if any(r["verdict"] == "MISMATCH" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
