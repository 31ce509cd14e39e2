"""`HangFindings`, the hang path's findings provider, alone: values in, findings out.

No monitor, no thread, no node I/O and no clock: the recorded polls' jobs and GPU
readings are handed to `observe` with their time, forensics' result to `complete`,
as the daemon layer's machinery (gpuwatchd/hangs/) hands them."""

from __future__ import annotations

import dataclasses
import threading

from gpuwatchd.config import Config
from gpuwatchd.config.schema import HangsConfig
from gpuwatchd.health.hangs.provider import Forensics, HangFindings
from gpuwatchd.health.hangs.signatures import builtin_catalog
from gpuwatchd.health.hangs.summary import summarize
from gpuwatchd.model import Severity
from tests.hangs.replay import polls

BASE = 1_800_000_000.0


def test_a_dead_peer_opens_one_finding_and_the_job_ending_resolves_it() -> None:
    cfg = dataclasses.replace(Config(), hangs=HangsConfig(ras=False))
    hangs = HangFindings(cfg)
    threads = threading.active_count()
    opened: list[float] = []
    for t, jobs, gpus in polls("peerdeath-polls.jsonl"):
        seen = hangs.observe(jobs, gpus, BASE + t, {}, {}, {})
        if seen.analyse and not opened:
            opened.append(t)
            assert seen.changed and not seen.waiting  # a dead rank pages at once
            version = hangs.version
            assert hangs.changed() and hangs.version == version + 1
    assert threading.active_count() == threads  # it starts none
    assert opened and 0 < opened[0] < 30  # as the monitor over the same polls
    (f,) = hangs.findings()
    assert f.alertname == "JobHangSuspected" and f.severity == Severity.CRITICAL
    assert dict(f.labels)["signature"] == "pending"
    # forensics' result, handed back: the signature names the finding
    (report,) = hangs.reports()
    rec = hangs.record(report.id)
    assert rec is not None
    summary = summarize(rec.job, rec.verdict, {}, None, builtin_catalog(), set())
    found = Forensics({}, False, (), (), summary, None, "not asked")
    done = hangs.complete(report.id, found)
    assert done is not None
    event, still_open = done
    assert still_open and event.kind == "job_hang" and event.hang is not None
    assert event.hang.ras_error == "not asked" and event.severity == Severity.CRITICAL
    assert dict(hangs.findings()[0].labels)["signature"] == event.hang.signature != ""
    # the job ends: resolved, its event to store
    seen = hangs.observe([], [], BASE + 300.0, {}, {}, {})
    assert seen.changed and hangs.findings() == []
    (resolved,) = seen.resolved
    assert resolved.hang is not None and resolved.hang.resolved_at == BASE + 300.0
    info = [s for s in hangs.samples() if s.name == "gpuwatchd_job_hang_info"]
    assert info == []
