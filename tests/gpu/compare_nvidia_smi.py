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
`no counterpart`. The rows are smi_rows.py, the verdicts smi_judge.py.

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
from collections.abc import Callable, Mapping
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
from smi_judge import compare, markdown, parse_q  # noqa: E402
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
from smi_rows import _rows  # noqa: E402


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
