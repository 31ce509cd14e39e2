"""Cost of GPM per poll: the `gpm_metrics` call alone and a whole GPU poll with and without it.

`gpm_metrics` takes one GPM sample (nvmlGpmSampleAlloc + nvmlGpmSampleGet),
computes the metrics against the previous poll's sample (nvmlGpmMetricsGet)
and frees that one. The whole-poll figures are DeviceReader.poll() on the
same GPU with the GPU's GPM flag on and off.

    .venv/bin/python benchmarks/bench_gpm.py --json OUT.json          # on a GPU machine
    .venv/bin/python benchmarks/bench_gpm.py --replay tests/fixtures/nvml/h100-gpm-record.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatchd.sources.nvml.client import NvmlClient, Pynvml  # noqa: E402
from gpuwatchd.sources.nvml.read import DeviceReader  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(values) * 1e3, 3),
        "p99_ms": round(pct(values, 0.99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(values) * 1e3, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replay")
    ap.add_argument("--polls", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between polls")
    ap.add_argument("--json")
    args = ap.parse_args()
    client: NvmlClient
    if args.replay:
        from gpuwatchd.sources.nvml.replay import ReplayClient

        client = ReplayClient.load(args.replay)
    else:
        client = Pynvml()
    client.init()
    count = client.call("device_count")
    assert isinstance(count, int)
    fig: dict[str, object] = {"gpus": count, "polls": args.polls}
    for index in range(count):
        reader = DeviceReader(index, processes=True)
        first = reader.poll(client.device, None)
        ident = first.identity
        assert ident is not None
        dev = reader.device
        assert dev is not None
        gpm_call: list[float] = []
        if ident.gpm:
            for _ in range(args.polls):
                t0 = time.perf_counter()
                dev.call("gpm_metrics")
                gpm_call.append(time.perf_counter() - t0)
                time.sleep(args.gap)
        polls: dict[str, list[float]] = {"with_gpm": [], "without_gpm": []}
        for mode, identity in (
            ("with_gpm", ident),
            ("without_gpm", dataclasses.replace(ident, gpm=False)),
        ):
            for _ in range(args.polls):
                polls[mode].append(reader.poll(client.device, identity, slow=False).seconds)
                time.sleep(args.gap)
        fig[f"gpu{index}"] = {
            "name": ident.name,
            "gpm_supported": ident.gpm,
            "gpm_metrics_call": summary(gpm_call) if gpm_call else None,
            "poll_with_gpm": summary(polls["with_gpm"]),
            "poll_without_gpm": summary(polls["without_gpm"]),
        }
        reader.release()
    client.shutdown()
    text = json.dumps(fig, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
