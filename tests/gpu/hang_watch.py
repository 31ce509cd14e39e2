"""Run the hang detector and forensics against the real GPU for a while.

    python3 tests/gpu/hang_watch.py --seconds 90 --out DIR [--since EPOCH] [--tag NAME]

Each second it reads NVML (utilisation, power, GPM SM activity, occupancy
and DRAM activity over the last second, compute processes), groups the
processes into jobs (tests/gpu uses the same adapter as the daemon), runs
the detector and, on the first suspicion of each job, captures every
rank's stack with py-spy, queries NCCL RAS (JSON and verbose text) and
matches the signature catalog. It writes DIR/TAG-polls.jsonl and
DIR/TAG-verdicts.json and prints one line per decision with the time since
--since (when the fault was injected).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector, HangThresholds  # noqa: E402
from gpuwatchd.health.hangs.signatures import builtin_catalog  # noqa: E402
from gpuwatchd.health.hangs.summary import summarize  # noqa: E402
from gpuwatchd.sources.hangs import ras, stacks  # noqa: E402
from gpuwatchd.sources.hangs.jobs import jobs_from_gpu_processes  # noqa: E402


class Gpus:
    """NVML readings with GPM over the last poll interval."""

    def __init__(self) -> None:
        import pynvml as nv

        self.nv = nv
        nv.nvmlInit()
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self.prev: list[object | None] = [None] * len(self.handles)
        self.gpm = []
        for h in self.handles:
            try:
                self.gpm.append(bool(nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice))
            except nv.NVMLError:
                self.gpm.append(False)

    def _gpm(self, i: int) -> dict[str, float]:
        nv = self.nv
        if not self.gpm[i]:
            return {}
        sample = nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmSampleGet(self.handles[i], sample)
        prev, self.prev[i] = self.prev[i], sample
        if prev is None:
            return {}
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version = nv.NVML_GPM_METRICS_GET_VERSION
        req.sample1, req.sample2 = prev, sample
        ids = {
            "sm": nv.NVML_GPM_METRIC_SM_UTIL,
            "occ": nv.NVML_GPM_METRIC_SM_OCCUPANCY,
            "dram": nv.NVML_GPM_METRIC_DRAM_BW_UTIL,
        }
        req.numMetrics = len(ids)
        for k, mid in enumerate(ids.values()):
            req.metrics[k].metricId = mid
        nv.nvmlGpmMetricsGet(req)
        nv.nvmlGpmSampleFree(prev)
        return {name: req.metrics[k].value / 100.0 for k, name in enumerate(ids)}

    def read(self) -> tuple[list[GpuActivity], dict[str, list[int]], list[dict[str, object]]]:
        nv = self.nv
        acts, pids, raw = [], {}, []
        for i, h in enumerate(self.handles):
            util = nv.nvmlDeviceGetUtilizationRates(h)
            power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            limit = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            g = self._gpm(i)
            procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            pids[str(i)] = [p.pid for p in procs]
            mem = {p.pid: p.usedGpuMemory for p in procs}
            act = GpuActivity(
                str(i),
                util.gpu / 100.0,
                util.memory / 100.0,
                power,
                limit,
                g.get("sm"),
                g.get("occ"),
                g.get("dram"),
            )
            acts.append(act)
            raw.append({**asdict(act), "processes": {str(k): v for k, v in mem.items()}})
        return acts, pids, raw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="watch")
    ap.add_argument("--since", type=float, default=0.0, help="epoch of the injected fault")
    ap.add_argument("--decide-after", type=float, default=60.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gpus = Gpus()
    det = HangDetector(HangThresholds(decide_after_seconds=args.decide_after))
    catalog = builtin_catalog()
    seen: set[str] = set()
    decisions = []
    polls = open(os.path.join(args.out, f"{args.tag}-polls.jsonl"), "w")
    start = time.time()
    since = args.since or start
    while time.time() - start < args.seconds:
        t0 = time.monotonic()
        now = time.time()
        acts, pids, raw = gpus.read()
        jobs = jobs_from_gpu_processes(pids)
        verdicts = det.observe(jobs, acts, now)
        polls.write(
            json.dumps(
                {
                    "t": round(now - since, 2),
                    "gpus": raw,
                    "jobs": [asdict(j) for j in jobs],
                    "verdicts": [asdict(v) for v in verdicts],
                }
            )
            + "\n"
        )
        polls.flush()
        for v in verdicts:
            if not v.suspected or v.job in seen:
                continue
            seen.add(v.job)
            job = next(j for j in jobs if j.job == v.job)
            caps = {r.pid: stacks.capture(r.pid, timeout=20) for r in job.ranks}
            answer_json = answer_text = None
            ras_error = ""
            try:
                answer_json = ras.query(job.ras_addr, timeout=10)
                answer_text = ras.query(job.ras_addr, fmt="text", verbose=True, timeout=10)
            except ras.RasError as e:
                ras_error = str(e)
            s = summarize(job, v, caps, answer_json.report if answer_json else None, catalog)
            record = {
                "job": v.job,
                "detected_after_s": round(now - since, 1),
                "conditions": v.conditions,
                "signals": v.signals,
                "reason": v.reason,
                "signature": s.signature.name if s.signature else "",
                "signatures": s.signatures,
                "where": s.where_line(),
                "missing": s.missing,
                "facts": s.facts,
                "diverging_frame": s.diverging_frame,
                "stacks": {
                    str(p): {
                        "ok": c.ok,
                        "error": c.error,
                        "seconds": round(c.seconds, 3),
                        "raw": c.raw,
                    }
                    for p, c in caps.items()
                },
                "ras_error": ras_error,
                "ras_json": answer_json.text if answer_json else "",
                "ras_text": answer_text.text if answer_text else "",
            }
            decisions.append(record)
            print(
                f"[{args.tag}] DETECTED job={v.job} after {record['detected_after_s']} s "
                f"conditions={','.join(v.conditions)} signals={v.signals} "
                f"signature={record['signature']} missing={s.missing} where={s.where_line()}",
                flush=True,
            )
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    polls.close()
    with open(os.path.join(args.out, f"{args.tag}-verdicts.json"), "w") as f:
        json.dump(decisions, f, indent=1)
    if not decisions:
        print(f"[{args.tag}] no hang suspected in {args.seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
