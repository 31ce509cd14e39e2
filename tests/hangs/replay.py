"""Feed the detector the polls recorded on an H100 (tests/fixtures/hangs/*-polls.jsonl)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from gpuwatchd.health.hangs.detector import GpuActivity, HangDetector, HangThresholds, JobVerdict
from gpuwatchd.sources.hangs.jobs import JobView, RankView

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hangs")


def fixture(name: str) -> str:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


def polls(name: str, gpm: bool = True) -> Iterator[tuple[float, list[JobView], list[GpuActivity]]]:
    """(seconds since the fault, jobs, GPU activity) per recorded poll."""
    for line in fixture(name).splitlines():
        row = json.loads(line)
        gpus = []
        for g in row["gpus"]:
            fields = {k: g.get(k) for k in GpuActivity.__dataclass_fields__}
            if not gpm:
                fields.update(sm_active=None, sm_occupancy=None, dram_active=None)
            gpus.append(GpuActivity(**fields))
        jobs = []
        for j in row["jobs"]:
            ranks = tuple(RankView(**{**r, "gpus": tuple(r["gpus"])}) for r in j.pop("ranks"))
            labels = tuple(tuple(p) for p in j.pop("labels"))
            jobs.append(JobView(**j, ranks=ranks, labels=labels))  # type: ignore[arg-type]
        yield row["t"], jobs, gpus


def replay(
    name: str, gpm: bool = True, thresholds: HangThresholds | None = None
) -> list[tuple[float, list[JobVerdict]]]:
    """Every poll's verdicts, with the poll's time relative to the fault."""
    det = HangDetector(thresholds or HangThresholds())
    out = []
    for t, jobs, gpus in polls(name, gpm):
        out.append((t, det.observe(jobs, gpus, 1_800_000_000.0 + t)))
    return out


def first_suspicion(name: str, gpm: bool = True) -> tuple[float, JobVerdict] | None:
    """When and what the detector first suspected, or None."""
    for t, verdicts in replay(name, gpm):
        for v in verdicts:
            if v.suspected:
                return t, v
    return None
