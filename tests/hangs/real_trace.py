"""Replay a recorded NCCL job (a fixture directory of tests/fixtures/hangs written by
tests/gpu/nccl_scenarios.py, e.g. dead-peer-2xh100) as the node the hang monitor reads:
a /proc tree rewritten each second from the recorded per-rank stat and io, NVML
snapshots from the recorded 1 s readings, the recorded RAS answers on a loopback RAS
server, and each rank's flight recorder dump behind its trigger pipe.

A fixture holds trace.json, nvml.jsonl (or trace.json's `nvml`), py-spy dumps named in
trace.json's `pyspy`, and fr-dump-rankN.pkl[.gz] per rank that left a dump."""

from __future__ import annotations

import gzip
import json
import os
import re
import select
import shlex
import shutil
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.health.hangs.gpu import (
    DRAM_ACTIVE,
    POWER,
    POWER_LIMIT,
    SM_ACTIVE,
    SM_OCCUPANCY,
    UTIL,
)
from gpuwatchd.model import Gpu, GpuInventory, GpuProcess, Sample, SourceSnapshot
from gpuwatchd.state import NodeSnapshot
from tests.hangs.replay import FIXTURES

DIR = os.path.join(FIXTURES, "dead-peer-2xh100")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Recorded GPM metrics: the daemon reads each as a mean over its poll interval.
GPM_KEYS = ("sm_active", "sm_occupancy", "dram_active")
PIPE_PREFIX = "/run/job/pipe_"  # the job's TORCH_NCCL_DEBUG_INFO_PIPE_FILE
DUMP_PREFIX = "/run/job/fr/dump_"
DUMP_STEP = (
    100_000,
    2_000_000,
)  # a 2,000-entry flight recorder dump: ~270 KB  # its TORCH_NCCL_DEBUG_INFO_TEMP_FILE
# what each recorded variable becomes in the replay (the harness's own paths and port)
PIPE_VARS = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE")
DUMP_VARS = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
DEAD_PEER_CMDLINE = ["python3", "tests/gpu/nccl_jobs.py", "dead_peer"]


def read(name: str, mode: str = "r", directory: str = DIR) -> Any:
    """A fixture file; NAME.gz when only that is there (flight recorder dumps)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", mode if "b" in mode else "rt") as g:
            return g.read()
    with open(path, mode) as f:
        return f.read()


def _nvml_rows(directory: str, doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    if any(os.path.exists(os.path.join(directory, n)) for n in ("nvml.jsonl", "nvml.jsonl.gz")):
        text = read("nvml.jsonl", directory=directory)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return list(doc.get("nvml") or [])


@dataclass
class Trace:
    """The recording of one fixture directory: /proc samples, RAS answers, NVML readings."""

    directory: str = DIR
    doc: dict[str, Any] = field(init=False)
    nvml: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.doc = json.loads(read("trace.json", directory=self.directory))
        self.nvml = _nvml_rows(self.directory, self.doc)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.directory))

    @property
    def kill(self) -> float:
        """The wall time the hang started (dead-peer: rank 1 SIGKILLed)."""
        return float(self.doc["hang_start"])

    @property
    def hang_start(self) -> float | None:
        """The hang's start; None for a control (or a hang that never came)."""
        t = self.doc.get("hang_start")
        return float(t) if t is not None else None

    @property
    def origin(self) -> float:
        """What replay times count from: the hang, a control's pause, else readiness."""
        for key in ("hang_start", "window_start", "t_ready"):
            if self.doc.get(key) is not None:
                return float(self.doc[key])
        return self.samples()[0][0]

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid."""
        return {int(r): int(p) for r, p in self.doc["ranks"].items()}

    @property
    def launch(self) -> str:
        return str(self.doc.get("scenario", {}).get("launch", "hand"))

    def samples(self) -> list[tuple[float, dict[int, dict[str, Any]]]]:
        """(wall time, rank -> /proc reading) once a second, from the ranks' launch.

        Without the flight recorder dumps asked during the recorded hang: the live
        daemon asked for one when it flagged and the harness later, and a replayed
        monitor that flags at another moment would read them as the job's writes (the
        daemon discounts only the dumps it asks for itself). A dump shows as one step
        of `wchar` (DUMP_STEP bytes) after the hang began, with no other write (but
        another dump) within 3 s around it; such steps are taken out of the rank's later readings.
        """
        rows = [
            (s["t"], {int(r): dict(v) for r, v in s["ranks"].items()})
            for s in self.doc["samples"]
            if s["ranks"]
        ]
        start = self.hang_start
        if start is None:
            return rows
        for rank in {r for _, rs in rows for r in rs}:
            series = [(t, rs[rank]) for t, rs in rows if "wchar" in rs.get(rank, {})]
            raw = [v["wchar"] for _, v in series]
            removed = 0
            for i in range(1, len(series)):
                step = raw[i] - raw[i - 1]
                around = range(max(1, i - 3), min(len(raw), i + 4))
                quiet = all(  # nothing else written around it (a second dump may be)
                    raw[j] == raw[j - 1] or DUMP_STEP[0] <= raw[j] - raw[j - 1] <= DUMP_STEP[1]
                    for j in around
                )
                if series[i][0] > start and DUMP_STEP[0] <= step <= DUMP_STEP[1] and quiet:
                    removed += step
                series[i][1]["wchar"] = raw[i] - removed
        return rows

    def harness_asks(self) -> dict[int, float]:
        """rank -> when the harness asked its flight recorder (pipe written)."""
        out: dict[int, float] = {}
        for ask in self.doc.get("fr_triggers") or []:
            name = str(ask.get("pipe", ""))
            digits = name.rsplit("_", 1)[-1].split(".")[0]
            if ask.get("ok") and digits.isdigit():
                out[int(digits)] = float(ask["t"])
        return out

    def boot_uptime(self) -> float:
        """The node's uptime at the launch: the earliest rank's start (clock ticks)."""
        rows = [r for _, ranks in self.samples() for r in ranks.values()]
        return min(r["starttime"] for r in rows if "starttime" in r) / 100.0

    def ras_answer(self, t: float, fmt: str) -> str | None:
        """The latest RAS answer in `fmt` (json, text) recorded at or before `t`."""
        got = [
            a["text"]
            for a in self.doc["ras"]
            if a["format"] == fmt and a["t"] <= t and a.get("text") and not a.get("error")
        ]
        return got[-1] if got else None

    def first_ras_answer(self, fmt: str) -> str:
        """The first answer in `fmt` that came ('' when RAS never answered)."""
        return next(
            (a["text"] for a in self.doc["ras"] if a["format"] == fmt and a.get("text")), ""
        )

    def nvml_row(self, t: float) -> dict[str, Any]:
        """The latest NVML reading at or before `t` (the first before any; none: no GPU)."""
        before = [row for row in self.nvml if row["t"] <= t]
        if before:
            return before[-1]
        return self.nvml[0] if self.nvml else {"t": t, "gpus": []}

    def nvml_poll(self, since: float, t: float) -> dict[str, Any]:
        """What the daemon's NVML poll at `t` reads when its last poll was at `since`.

        Utilization, memory utilization and power are the latest reading's (NVML
        reports them over its last sample period, a second at most). GPM metrics are
        the mean over the poll's interval: the daemon computes them between the GPM
        samples of two polls, so a kernel that stopped doing work in the middle of an
        interval reads as half busy until the next poll. The harness recorded GPM
        once a second; taking the latest second alone made the replay see a stuck
        kernel up to one NVML interval before the device did."""
        row = self.nvml_row(t)
        window = [r for r in self.nvml if since < r["t"] <= t] or [row]
        gpus = []
        for g in row["gpus"]:
            g = dict(g)
            for key in GPM_KEYS:
                got = [
                    x[key]
                    for r in window
                    for x in r["gpus"]
                    if x["gpu"] == g["gpu"] and x.get(key) is not None
                ]
                if got:
                    g[key] = sum(got) / len(got)
            gpus.append(g)
        return {**row, "gpus": gpus}

    def environ(self, ras_addr: str) -> dict[int, dict[str, str]]:
        """Each rank's launch variables as recorded, pointed at the replay's RAS and pipes.

        Recordings before trace.json kept `environ` were launched by hand: rank_env."""
        recorded = self.doc.get("environ")
        if not recorded:
            world = len(self.pids)
            return {r: rank_env(r, ras_addr, world) for r in self.pids}
        out: dict[int, dict[str, str]] = {}
        for rank, env in recorded.items():
            env = dict(env)
            env["NCCL_RAS_ADDR"] = ras_addr
            for key in PIPE_VARS:
                if key in env:
                    env[key] = PIPE_PREFIX
            for key in DUMP_VARS:
                if key in env:
                    env[key] = DUMP_PREFIX
            out[int(rank)] = env
        for rank in self.pids:  # a rank the harness could not read: its neighbour's
            if rank not in out and out:
                other = dict(next(iter(out.values())))
                out[rank] = {**other, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        return out

    def cmdlines(self) -> dict[int, list[str]]:
        """Each rank's argv: its own command (by hand), the script torchrun starts."""
        commands = [shlex.split(c) for c in self.doc.get("commands") or []]
        out: dict[int, list[str]] = {}
        by_hand = self.launch != "torchrun"
        for rank in self.pids:
            argv = commands[rank] if by_hand and rank < len(commands) else []
            if not argv and commands:  # torchrun: its workers run `python -u SCRIPT ...`
                argv = commands[0]
                script = next((i for i, a in enumerate(argv) if a.endswith(".py")), None)
                argv = ["python3", "-u", *argv[script:]] if script is not None else argv
            if argv:
                argv = ["python3", *argv[1:]] if argv[0].endswith(("python", "python3")) else argv
            out[rank] = argv or DEAD_PEER_CMDLINE
        return out

    def pyspy(self, pid: int) -> list[str]:
        """The recorded `py-spy dump --native` texts of one pid that worked, in order."""
        runs = [p for p in self.doc.get("pyspy") or [] if p.get("pid") == pid and p.get("rc") == 0]
        runs.sort(key=lambda p: p.get("t", 0.0))
        return [
            read(p["file"], directory=self.directory)
            for p in runs
            if os.path.exists(os.path.join(self.directory, p["file"]))
        ]

    def flight_dumps(self) -> dict[int, bytes]:
        """rank -> its flight recorder dump as written (fr-dump-rankN.pkl or .pkl.gz)."""
        out: dict[int, bytes] = {}
        for name in sorted(os.listdir(self.directory)):
            m = re.fullmatch(r"fr-dump-rank(\d+)\.pkl(\.gz)?", name)
            if m:
                out[int(m.group(1))] = read(name.removesuffix(".gz"), "rb", self.directory)
        return out


def nvml_snapshot(row: Mapping[str, Any], stamp: float) -> NodeSnapshot:
    """The NVML source's snapshot of one reading: samples the detector reads, processes."""
    samples = []
    gpus: list[Gpu] = []
    for g in row["gpus"]:
        gpu = g["gpu"]
        for name, key, extra in (
            (UTIL, "utilization", {"engine": "gpu"}),
            (UTIL, "memory_utilization", {"engine": "memory"}),
            (POWER, "power_watts", {}),
            (POWER_LIMIT, "power_limit_watts", {}),
            (SM_ACTIVE, "sm_active", {}),
            (SM_OCCUPANCY, "sm_occupancy", {}),
            (DRAM_ACTIVE, "dram_active", {}),
        ):
            if g.get(key) is not None:
                samples.append(Sample.of(name, g[key], gpu=gpu, **extra))
        procs = tuple(
            GpuProcess(pid=int(p), used_memory_bytes=m) for p, m in g["processes"].items()
        )
        bus = f"0000:00:{6 + int(gpu):02x}.0"
        gpus.append(Gpu(index=int(gpu), pci_bus_id=bus, processes=procs))
    inventory = GpuInventory(tuple(gpus))
    nvml = SourceSnapshot("nvml", tuple(samples), True, timestamp=stamp, payload=inventory)
    return NodeSnapshot(sources={"nvml": nvml})


def _stat(pid: int, r: Mapping[str, Any]) -> str:
    utime, stime = round(r["utime_s"] * CLK_TCK), round(r["stime_s"] * CLK_TCK)
    # fields after "(comm) ": state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice num_threads itrealvalue starttime
    rest = f"{r['state']} 1000 {pid} 1000 0 -1 4194560 0 0 0 0 {utime} {stime} 0 0 20 0"
    return f"{pid} (python3) {rest} {r['threads']} 0 {r['starttime']} 0 0\n"


def _io(r: Mapping[str, Any]) -> str:
    keys = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")
    return "".join(f"{k}: {r.get(k, 0)}\n" for k in keys) + "cancelled_write_bytes: 0\n"


class ProcTree:
    """A procfs the hang path reads (stat, task stat, io, environ, cmdline, uptime, root)."""

    def __init__(
        self,
        root: str,
        env: Mapping[int, Mapping[str, str]],
        cmdline: Mapping[int, list[str]] | None = None,
    ) -> None:
        self.root = root
        self.env = env
        self.cmdline = cmdline or {}
        os.makedirs(root, exist_ok=True)

    def write(self, uptime: float, ranks: Mapping[int, Mapping[str, Any]]) -> None:
        """The tree as of one sample; a rank the sample has gone is removed."""
        self._put("uptime", f"{uptime:.2f} 0.00\n")
        for rank, r in ranks.items():
            pid = int(r["pid"])
            base = os.path.join(self.root, str(pid))
            if "state" not in r:  # reaped: no /proc entry any more
                shutil.rmtree(base, ignore_errors=True)
                continue
            if not os.path.exists(os.path.join(base, "environ")):
                env = "".join(f"{k}={v}\0" for k, v in self.env.get(rank, {}).items())
                self._put(f"{pid}/environ", env)
                argv = self.cmdline.get(rank, DEAD_PEER_CMDLINE)
                self._put(f"{pid}/cmdline", "".join(a + "\0" for a in argv))
                os.makedirs(os.path.join(base, "root", "run", "job", "fr"), exist_ok=True)
            self._put(f"{pid}/stat", _stat(pid, r))
            self._put(f"{pid}/task/{pid}/stat", _stat(pid, r))  # one task: the totals
            self._put(f"{pid}/io", _io(r))

    def _put(self, rel: str, text: str) -> None:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:  # read by the same thread between steps
            f.write(text)


def rank_env(rank: int, ras_addr: str, world: int = 2) -> dict[str, str]:
    """The launch environment of the first recorded job (nccl_jobs.py by hand, 2 ranks)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29600",
        "NCCL_RAS_ADDR": ras_addr,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": PIPE_PREFIX,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": DUMP_PREFIX,
    }


class FlightRank:
    """A rank's dump pipe as PyTorch serves it: a byte written to it writes the dump.

    A rank without a FlightRank has no pipe reader (dead, or it left no dump): opening
    its pipe fails, as the harness recorded for the dead peer (ENXIO)."""

    def __init__(self, proc: ProcTree, pid: int, rank: int, dump: bytes) -> None:
        root = os.path.join(proc.root, str(pid), "root")
        self.pid = pid
        self.pipe = root + f"{PIPE_PREFIX}{rank}.pipe"
        self.dump_path = root + f"{DUMP_PREFIX}{rank}"
        self.dump = dump
        self.triggered = 0
        self.written = threading.Event()
        os.makedirs(os.path.dirname(self.pipe), exist_ok=True)
        os.makedirs(os.path.dirname(self.dump_path), exist_ok=True)
        os.mkfifo(self.pipe)
        self._fd = os.open(self.pipe, os.O_RDONLY | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.05)
            if ready and os.read(self._fd, 64):
                self.triggered += 1
                with open(self.dump_path + ".tmp", "wb") as f:
                    f.write(self.dump)
                os.replace(self.dump_path + ".tmp", self.dump_path)
                self.written.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        os.close(self._fd)


def pyspy_dumps() -> Iterator[str]:
    """The dead peer's survivor: its two recorded `py-spy dump --native` texts, 5 s apart."""
    for i in (1, 2):
        yield read(f"pyspy-{i}-1272.txt")


def healthy_answer(counts: Mapping[int, int], template: str) -> str:
    """A recorded healthy JSON answer with each rank's AllReduce count replaced."""
    parts = re.split(r'("AllReduce": )\d+', template)
    assert len(parts) == 2 * len(counts) + 1, "one AllReduce count per rank"
    out = parts[0]
    for i, rank in enumerate(sorted(counts)):
        out += parts[1 + 2 * i] + str(counts[rank]) + parts[2 + 2 * i]
    return out
