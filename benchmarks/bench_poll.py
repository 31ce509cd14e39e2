"""Cost of one NVML poll cycle per GPU, on real NVML (or a replay, for a dry run).

Measures NvmlSource.poll() wall time over N polls in two modes: a regular
poll (NVLink error counters skipped, as between their own 60 s interval) and
a full poll that also reads every NVLink error counter. Also times one
`nvidia-smi --query-gpu=...` scrape (query + render), what an nvidia-smi based
exporter makes per scrape, and gives the ratio.

    .venv/bin/python benchmarks/bench_poll.py --section poll-h200       # on a GPU machine
    .venv/bin/python benchmarks/bench_poll.py --replay tests/fixtures/nvml/h200x2-record.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scrape import pct, peer_scrape  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from gpuwatchd.sources.nvml.client import Pynvml  # noqa: E402
from gpuwatchd.sources.nvml.source import NvmlSource  # noqa: E402


def run(source: NvmlSource, polls: int) -> list[float]:
    out = []
    for _ in range(polls):
        t0 = time.perf_counter()
        source.poll(time.time())
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replay")
    ap.add_argument("--polls", type=int, default=50)
    ap.add_argument("--section", default="")
    ap.add_argument("--json")
    args = ap.parse_args()

    def make(nvlink_every: float) -> NvmlSource:
        if args.replay:
            from gpuwatchd.sources.nvml.replay import ReplayClient

            return NvmlSource(ReplayClient.load(args.replay), nvlink_error_interval=nvlink_every)
        return NvmlSource(Pynvml(), nvlink_error_interval=nvlink_every)

    regular = make(1e9)  # NVLink errors read at the first poll only
    regular.poll(time.time())  # init + first full poll, not timed
    gpus = len(regular.status().get("gpus", {}) or {}) or 1
    reg = run(regular, args.polls)
    regular.close()
    full = make(0.0)  # every poll reads every NVLink error counter
    full.poll(time.time())
    ful = run(full, max(5, args.polls // 5))
    full.close()

    fig: dict[str, object] = {
        "gpus": gpus,
        "regular_poll_ms_p50": pct(reg, 0.5) * 1e3,
        "regular_poll_ms_per_gpu": pct(reg, 0.5) * 1e3 / gpus,
        "full_poll_ms_p50": pct(ful, 0.5) * 1e3,
        "full_poll_ms_per_gpu": pct(ful, 0.5) * 1e3 / gpus,
        "regular_poll_ms_mean": statistics.fmean(reg) * 1e3,
    }
    if shutil.which("nvidia-smi") and not args.replay:
        smi = [peer_scrape() for _ in range(10)]  # the query an nvidia-smi exporter runs
        fig["nvidia_smi_ms_p50"] = pct(smi, 0.5) * 1e3
        fig["ratio_smi_over_regular_poll"] = fig["nvidia_smi_ms_p50"] / fig["regular_poll_ms_p50"]
    rows = [
        f"| GPUs | {gpus} ({'replay ' + args.replay if args.replay else 'real NVML'}) |",
        f"| regular poll, all GPUs (p50 of {args.polls}) | {fig['regular_poll_ms_p50']:.2f} ms |",
        f"| regular poll per GPU | {fig['regular_poll_ms_per_gpu']:.2f} ms |",
        f"| full poll incl. every NVLink error counter, per GPU | "
        f"{fig['full_poll_ms_per_gpu']:.1f} ms |",
    ]
    if "nvidia_smi_ms_p50" in fig:
        rows += [
            f"| nvidia-smi exporter scrape, query + render (p50 of 10) | "
            f"{fig['nvidia_smi_ms_p50']:.1f} ms |",
            f"| ratio nvidia-smi / regular poll | {fig['ratio_smi_over_regular_poll']:.0f}x |",
        ]
    publish(fig, "NVML poll cost", rows, args.section, args.json or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
