"""The real dead-peer hang (issue 21) replayed through the hang monitor on its defaults.

2 ranks of a DDP job on 2x H100 over NVLink (PyTorch 2.11, NCCL 2.28.9); 10 s after
both were ready rank 1 (pid 1274) was SIGKILLed while rank 0 (pid 1272) waited in an
all_reduce. The daemon of the time flagged nothing in the 45 s watched. Here the
monitor reads what the node showed, second by second: the recorded /proc of each rank
(rank 1 a zombie, then gone), NVML every 10 s from the recorded 1 s readings, NCCL
RAS on a loopback server answering what RAS answered at that time (NCCL 2.28.9's
malformed JSON after the kill), rank 0's flight recorder dump behind its trigger pipe
and the two recorded py-spy dumps of the survivor.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import Config
from gpuwatchd.forensics import NodeForensics
from gpuwatchd.hangs.monitor import HangMonitor
from gpuwatchd.health.hangs.gpu import HangThresholds
from gpuwatchd.health.hangs.summary import where_stuck
from gpuwatchd.jobview import StackCapture
from gpuwatchd.model import Finding
from gpuwatchd.sources.hangs import flight, stacks
from tests.hangs.ras_server import RasReplayServer, ras_server
from tests.hangs.real_trace import (
    FlightRank,
    ProcTree,
    Trace,
    healthy_answer,
    nvml_snapshot,
    pyspy_dumps,
    rank_env,
    read,
)

TRACE = Trace()
KILL = TRACE.kill
NVML_INTERVAL = Config().sources.nvml.interval  # 10 s
PROBE_INTERVAL = Config().hangs.probe_interval_seconds  # 3 s


def every_gpu_worked_at(phase: float) -> float | None:
    """The NVML poll (seconds from the kill) by which both ranks' GPUs had read at work.

    None at the phases whose polls caught GPU 0 or 1 just below the work floor (an SM
    activity of 0.299 and 0.294 against 0.30): there the age grace holds until a rank dies.
    """
    floor = HangThresholds().min_work_sm_active
    worked: set[str] = set()
    t = TRACE.samples()[0][0] + phase
    while t < KILL:
        row = TRACE.nvml_row(t)["gpus"]
        worked |= {g["gpu"] for g in row if (g.get("sm_active") or 0.0) >= floor}
        if worked >= {"0", "1"}:
            return t - KILL
        t += NVML_INTERVAL
    return None


def recorded_stack(pid: int, text: str) -> StackCapture:
    python, threads = stacks.parse_dump(text)
    return StackCapture(pid, True, threads, python=python, raw=text)


class Node:
    """The monitor beside the recorded job: its clock, /proc tree, NVML and RAS."""

    def __init__(self, tmp: Path, srv: RasReplayServer, cfg: Config, phase: float) -> None:
        self.srv = srv
        self.proc = ProcTree(str(tmp / "proc"), {r: rank_env(r, srv.addr) for r in TRACE.pids})
        cfg = dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, procfs=self.proc.root))
        first = TRACE.samples()[0][0]
        self.clock = FakeClock(start=first)
        self.launch = float(TRACE.doc["t_launch"])
        self.boot = TRACE.samples()[0][1][0]["starttime"] / 100.0  # uptime at the launch
        dumps = itertools.cycle(list(pyspy_dumps()))
        self.stacks_taken: list[float] = []

        def capture(pid: int) -> StackCapture:  # py-spy as recorded, 5 s apart
            self.stacks_taken.append(self.clock.time() - KILL)
            return recorded_stack(pid, next(dumps))

        self.monitor = HangMonitor(
            cfg, self.clock, io=NodeForensics(), ras_workers=0, capture=capture
        )
        self.found: list[tuple[float, list[Finding]]] = []
        self.monitor.add_listener(lambda f, now: self.found.append((now - KILL, list(f))))
        self.phase = phase  # seconds after the first sample of the first NVML poll
        self.next_nvml = first + phase
        self.ras_asked: list[float] = []
        self.timeline: list[tuple[float, str, str, str]] = []
        self.extra_wchar: dict[int, int] = {}  # rank -> bytes it wrote beyond the recording

    def step(
        self, t: float, ranks: dict[int, dict[str, Any]], nvml: dict[str, Any], ras_json: str
    ) -> None:
        """One second of the node: /proc now, an NVML poll when due, the consumer's tick."""
        self.clock.advance(t - self.clock.time())
        for rank, extra in self.extra_wchar.items():
            if "wchar" in ranks[rank]:
                ranks = {**ranks, rank: {**ranks[rank], "wchar": ranks[rank]["wchar"] + extra}}
        self.proc.write(self.boot + t - self.launch, ranks)
        self.srv.json_answer = ras_json
        asked = len(self.srv.requests)
        if t >= self.next_nvml:
            self.next_nvml += NVML_INTERVAL
            self.monitor.on_publish(nvml_snapshot(nvml, t))
        self.monitor.tick()
        if len(self.srv.requests) > asked:
            self.ras_asked.append(t - KILL)
        for v in self.monitor.detector._verdicts:
            row = (round(t - KILL, 1), ",".join(v.conditions), v.signals, v.severity)
            if not self.timeline or self.timeline[-1][1:] != row[1:]:
                self.timeline.append(row)


def recorded(node: Node, until: float, forensics: bool = False, first: bool = False) -> None:
    """Replay the recording up to `until` seconds after the kill (`first`: or a verdict)."""
    # before RAS first answered (-7 s), the earliest answer: a healthy one, as the job trained
    first_json = TRACE.first_ras_answer("json")
    for t, ranks in TRACE.samples():
        if t - KILL > until:
            return
        node.step(t, ranks, TRACE.nvml_row(t), TRACE.ras_answer(t, "json") or first_json)
        if forensics:
            node.monitor.run_pending()
        if first and node.found:
            return


@pytest.fixture
def srv() -> Iterator[RasReplayServer]:
    text = TRACE.ras_answer(KILL, "text") or ""
    with ras_server(text, TRACE.ras_answer(KILL, "json") or "") as s:
        yield s


def decided_by(f: Finding) -> set[str]:
    return set(f.reason.split("Decided by: ")[1].split(".")[0].split("+"))


@pytest.mark.parametrize("phase", range(int(NVML_INTERVAL)))
def test_real_dead_peer_is_decided_within_30_s_at_every_nvml_phase(
    tmp_path: Path, srv: RasReplayServer, phase: int
) -> None:
    """Defaults; NVML's 10 s poll at each of its 10 possible offsets from the kill."""
    node = Node(tmp_path, srv, Config(), float(phase))
    recorded(node, until=30.0, first=True)
    assert node.found, f"no verdict within 30 s of the kill; timeline {node.timeline}"
    at, (f,) = node.found[0]
    assert 0 < at <= 30.0
    assert f.severity.name == "CRITICAL" and f.alertname == "JobHangSuspected"
    assert "rank 1 died (pid 1274)" in f.reason
    assert dict(f.labels)["job_id"] == "torch:127.0.0.1:29600"
    assert dict(f.labels)["role"] == "culprit"
    # liveness (rank 1 gone) with the survivor's GPU resident but far below its peak
    assert {"liveness", "gpu"} <= decided_by(f)
    # RAS is asked once both ranks' GPUs worked (within a probe), never before; at the
    # phases where no poll read both at work, not while both ranks lived (the age grace)
    worked = every_gpu_worked_at(phase)
    if worked is None:  # launched 30 s before the kill: not before the age grace ends
        grace_end = TRACE.doc["t_launch"] - KILL + Config().hangs.startup_grace_seconds
        assert all(t >= grace_end - 1.0 for t in node.ras_asked), node.ras_asked
    else:
        assert node.ras_asked and worked <= node.ras_asked[0] <= worked + PROBE_INTERVAL + 1


@pytest.mark.parametrize(("phase", "first_asked"), [(0, (-11.5, -10.5)), (3, (-1.0, 3.0))])
def test_real_ras_answers_name_the_dead_rank(
    tmp_path: Path, srv: RasReplayServer, phase: int, first_asked: tuple[float, float]
) -> None:
    """NCCL 2.28.9's malformed JSON (the answer with a missing rank) is read, not dropped.

    Phase 0: both GPUs read at work at -14 s, so RAS is asked at the next probe while the
    job trains (a healthy answer). Phase 3: GPU 0 never read at work before the kill and
    the ranks were launched 30 s before it: first asked once the youngest is 30 s old
    (the age grace), about at the kill.
    """
    node = Node(tmp_path, srv, Config(), float(phase))
    recorded(node, until=45.0)
    assert node.ras_asked and first_asked[0] <= node.ras_asked[0] <= first_asked[1]
    assert srv.requests[0] == ["CLIENT PROTOCOL 2", "TIMEOUT 5", "SET FORMAT json", "STATUS"]
    assert all(t > 0.0 for t, _ in node.found)  # the healthy answers flag nothing
    (f,) = node.monitor.findings()
    assert f.severity.name == "CRITICAL"
    assert "rank 1 died (pid 1274)" in f.reason and "RAS cannot reach it" in f.reason
    assert "ras" in decided_by(f) and "Ranks lost on: 192.0.2.2" in f.reason


def test_real_dead_peer_stays_one_open_hang_while_rank_1_is_dead(
    tmp_path: Path, srv: RasReplayServer
) -> None:
    node = Node(tmp_path, srv, Config(), 0.0)
    recorded(node, until=45.0)
    at, _ = node.found[0]
    assert all(found for t, found in node.found if t >= at), node.timeline
    assert len(node.monitor.records()) == 1
    (f,) = node.monitor.findings()  # RAS (asked from -11 s) confirmed the open hang
    assert {"liveness", "gpu", "ras"} <= decided_by(f) and "RAS cannot reach it" in f.reason


@pytest.mark.parametrize("phase", [0, 3])
def test_real_dead_peer_forensics_stacks_and_flight_recorder(
    tmp_path: Path, srv: RasReplayServer, phase: int
) -> None:
    """`hangs.stacks: true` (the recorded py-spy dumps) and the flight recorder's pipe.

    Phase 0: the job's GPUs worked, RAS was asked and its answer is in the record.
    Phase 3: they never read at work; RAS is asked once the ranks are 30 s old (the age
    grace), about at the kill: its answer names the missing rank too."""
    cfg = Config()
    hangs = dataclasses.replace(cfg.hangs, stacks=True, stacks_confirm_seconds=0.0)
    node = Node(tmp_path, srv, dataclasses.replace(cfg, hangs=hangs), float(phase))
    fr = FlightRank(node.proc, TRACE.pids[0], 0, read("fr-dump-rank0.pkl", "rb"))
    try:
        recorded(node, until=19.0, forensics=True)
    finally:
        fr.close()
    at, (first,) = node.found[0]
    assert at <= 30.0 and dict(first.labels)["signature"] == "pending"  # paged at once
    (f,) = node.monitor.findings()
    assert f.severity.name == "CRITICAL" and dict(f.labels)["signature"] == "dead_peer"
    assert node.stacks_taken == [at, at]  # two dumps, the survivor only
    assert "Two stack dumps seconds apart show every rank in the same call" in f.reason
    where = dict(f.labels)["where"]
    assert where.startswith("rank 0 (pid 1272): cuStreamSynchronize; rank 1 (pid 1274): gone")
    assert fr.triggered == 1  # rank 0's pipe; rank 1 has no reader
    (doc,) = node.monitor.records()
    assert doc["flight_recorder"] == [
        "process group 0: rank 0 at #25177 nccl:all_reduce (scheduled)"
    ]
    assert doc["flight_recorder_errors"] == []
    assert doc["ras"]["error"] == "" and '"missing_ranks_count": 1' in doc["ras"]["answer"]
    assert "rank 1 on 192.0.2.2 pid 1274 (RAS, communicator 0x3f8a81094df1762e)" in (doc["missing"])


DUMP_WCHAR = 269_688  # rank 0's wchar across its dump at +20 s (trace.json samples)


def test_the_monitors_own_flight_trigger_does_not_clear_its_page(
    tmp_path: Path, srv: RasReplayServer
) -> None:
    """Defaults (flight_recorder on): rank 0 writes what it wrote when the harness asked."""
    node = Node(tmp_path, srv, Config(), 0.0)
    fr = FlightRank(node.proc, TRACE.pids[0], 0, read("fr-dump-rank0.pkl", "rb"))
    first_json = TRACE.first_ras_answer("json")
    try:
        for t, ranks in TRACE.samples():
            if t - KILL > 19.0:  # the harness's own trigger came at +20 s
                break
            node.step(t, ranks, TRACE.nvml_row(t), TRACE.ras_answer(t, "json") or first_json)
            node.monitor.run_pending()
            node.extra_wchar[0] = fr.triggered * DUMP_WCHAR
    finally:
        fr.close()
    assert fr.triggered == 1
    at, _ = node.found[0]
    assert all(found for t, found in node.found if t >= at), node.timeline


def test_recorded_flight_dump_parses_safely_with_the_step_rank_0_reached() -> None:
    doc = flight.parse_dump(read("fr-dump-rank0.pkl", "rb"))
    entries = doc["entries"]
    assert doc["version"] == "2.10" and doc["comm_lib_version"] == "2.28.9"
    assert isinstance(entries, list) and len(entries) == 2000  # the ring: TORCH_FR_BUFFER_SIZE
    status = doc["pg_status"]
    assert isinstance(status, dict) and status["0"]["last_completed_collective"] == 25147
    (group,) = flight.progress({0: doc})
    assert group.pg == "0"
    assert group.reached == {0: (25177, "nccl:all_reduce", "scheduled")}
    assert group.waiting_in == (25177, "nccl:all_reduce")
    assert group.not_joined == () and group.ops_differ == ()  # rank 1 left no dump


def test_recorded_stacks_show_the_survivor_in_a_stream_synchronize() -> None:
    first, second = (recorded_stack(1272, t) for t in pyspy_dumps())
    assert where_stuck(first) == where_stuck(second) == ("cuStreamSynchronize", "")
    main = first.main_thread()
    assert main is not None and main.name == "MainThread"
    # DDP's all_reduce is asynchronous: the host waits in .item() of the step's loss
    names = [f.function for f in main.frames]
    assert names[-5:-1] == ["_train", "run_real", "main", "<module>"]
    item = next(i for i, n in enumerate(names) if n.endswith("THPVariable_item"))
    assert names.index("cuStreamSynchronize") < item


def _rates(samples: list[tuple[float, dict[int, dict[str, Any]]]]) -> dict[int, dict[str, float]]:
    (t0, a), (t1, b) = samples[0], samples[-1]
    keys = ("utime_s", "stime_s", "rchar", "wchar", "syscr", "syscw")
    return {r: {k: (b[r][k] - a[r][k]) / (t1 - t0) for k in keys} for r in a}


def test_healthy_training_and_its_continuation_stay_quiet(
    tmp_path: Path, srv: RasReplayServer
) -> None:
    """The 10 s before the kill as recorded, then 120 s going on at the recorded rates."""
    before = [(t, r) for t, r in TRACE.samples() if -10.5 < t - KILL < -0.5]
    rows = [row for row in TRACE.nvml if -10.5 < row["t"] - KILL < -0.5]
    rates = _rates(before)
    healthy = [a for a in TRACE.doc["ras"] if a["format"] == "json" and a["t"] < KILL]
    (c0, c1) = (
        {r["rank"]: r["counts"]["AllReduce"] for r in a["parsed"]["communicators"][0]["ranks"]}
        for a in healthy
    )
    per_s = (c1[0] - c0[0]) / (healthy[1]["t"] - healthy[0]["t"])
    node = Node(tmp_path, srv, Config(), 0.0)
    node.clock.advance(before[0][0] - node.clock.time())
    for t, ranks in before:
        node.step(t, ranks, TRACE.nvml_row(t), healthy[-1]["text"])
    t_last, last = before[-1]
    for k in range(1, 121):
        ranks = {
            r: {**v, **{key: v[key] + type(v[key])(rate * k) for key, rate in rates[r].items()}}
            for r, v in last.items()
        }
        counts = {r: n + round(per_s * (t_last + k - healthy[1]["t"])) for r, n in c1.items()}
        answer = healthy_answer(counts, healthy[1]["text"])
        node.step(t_last + k, ranks, rows[k % len(rows)], answer)
    assert node.found == [] and node.monitor.findings() == []
    assert all(v.conditions == () for v in node.monitor.detector._verdicts)
    assert len(node.ras_asked) >= 5  # polled from the end of the grace, counts rising


def test_the_monitors_own_flight_dump_does_not_resolve_a_stall_of_live_ranks(
    tmp_path: Path, srv: RasReplayServer
) -> None:
    """Both ranks alive and idle (no CPU, no I/O, GPUs quiet; RAS off): `cpu_stall`.

    The monitor's flight recorder trigger makes rank 0 write its 270 KB dump; that I/O
    is the monitor's own, so the stall stays one open hang instead of resolving and
    coming back as a second record a minute later.
    """
    cfg = Config()
    node = Node(
        tmp_path,
        srv,
        dataclasses.replace(cfg, hangs=dataclasses.replace(cfg.hangs, ras=False)),
        0.0,
    )
    fr = FlightRank(node.proc, TRACE.pids[0], 0, read("fr-dump-rank0.pkl", "rb"))
    t0, frozen = [(t, r) for t, r in TRACE.samples() if t < KILL][-1]
    quiet = {"utilization": 0.0, "sm_active": 0.0, "sm_occupancy": 0.0, "power_watts": 80.0}
    row = TRACE.nvml_row(t0)
    row = {**row, "gpus": [{**g, **quiet} for g in row["gpus"]]}
    try:
        for k in range(150):
            node.step(t0 + k, frozen, row, "")
            node.monitor.run_pending()
            node.extra_wchar[0] = fr.triggered * DUMP_WCHAR
    finally:
        fr.close()
    assert fr.triggered == 1
    assert node.found, node.timeline
    at, _ = node.found[0]
    assert all(found for t, found in node.found if t >= at), node.timeline
    assert len(node.monitor.records()) == 1
