"""Replay a recorded 2-GPU NCCL job (tests/fixtures/hangs/dead-peer-2xh100) as the node
the hang monitor reads: a /proc tree rewritten each second from the recorded per-rank
stat and io, NVML snapshots from the recorded 1 s readings, the recorded RAS answers
on a loopback RAS server, and rank 0's flight recorder dump behind its trigger pipe."""

from __future__ import annotations

import json
import os
import re
import select
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
PIPE_PREFIX = "/run/job/pipe_"  # the job's TORCH_NCCL_DEBUG_INFO_PIPE_FILE
DUMP_PREFIX = "/run/job/fr/dump_"  # its TORCH_NCCL_DEBUG_INFO_TEMP_FILE


def read(name: str, mode: str = "r") -> Any:
    with open(os.path.join(DIR, name), mode) as f:
        return f.read()


@dataclass
class Trace:
    """The recording: /proc samples and RAS answers (trace.json), NVML readings."""

    doc: dict[str, Any] = field(default_factory=lambda: json.loads(read("trace.json")))
    nvml: list[dict[str, Any]] = field(
        default_factory=lambda: [json.loads(line) for line in read("nvml.jsonl").splitlines()]
    )

    @property
    def kill(self) -> float:
        """The wall time rank 1 was SIGKILLed (the hang's start)."""
        return float(self.doc["hang_start"])

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid."""
        return {int(r): int(p) for r, p in self.doc["ranks"].items()}

    def samples(self) -> list[tuple[float, dict[int, dict[str, Any]]]]:
        """(wall time, rank -> /proc reading) once a second, from the ranks' launch."""
        return [
            (s["t"], {int(r): v for r, v in s["ranks"].items()})
            for s in self.doc["samples"]
            if s["ranks"]
        ]

    def ras_answer(self, t: float, fmt: str) -> str | None:
        """The latest RAS answer in `fmt` (json, text) recorded at or before `t`."""
        got = [a["text"] for a in self.doc["ras"] if a["format"] == fmt and a["t"] <= t]
        return got[-1] if got else None

    def nvml_row(self, t: float) -> dict[str, Any]:
        """The latest NVML reading at or before `t`."""
        return [row for row in self.nvml if row["t"] <= t][-1]


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
        bus = f"0000:00:0{6 + int(gpu)}.0"
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
    return "".join(f"{k}: {r[k]}\n" for k in keys) + "cancelled_write_bytes: 0\n"


class ProcTree:
    """A procfs the hang path reads (stat, task stat, io, environ, cmdline, uptime, root)."""

    def __init__(self, root: str, env: Mapping[int, Mapping[str, str]]) -> None:
        self.root = root
        self.env = env
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
                env = "".join(f"{k}={v}\0" for k, v in self.env[rank].items())
                self._put(f"{pid}/environ", env)
                self._put(f"{pid}/cmdline", "python3\0tests/gpu/nccl_jobs.py\0dead_peer\0")
                os.makedirs(os.path.join(base, "root", "run", "job", "fr"), exist_ok=True)
            self._put(f"{pid}/stat", _stat(pid, r))
            self._put(f"{pid}/task/{pid}/stat", _stat(pid, r))  # one task: the totals
            self._put(f"{pid}/io", _io(r))

    def _put(self, rel: str, text: str) -> None:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:  # read by the same thread between steps
            f.write(text)


def rank_env(rank: int, ras_addr: str) -> dict[str, str]:
    """The launch environment of the recorded job (nccl_jobs.py by hand, 2 ranks)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29600",
        "NCCL_RAS_ADDR": ras_addr,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": PIPE_PREFIX,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": DUMP_PREFIX,
    }


class FlightRank:
    """Rank 0's dump pipe as PyTorch serves it: a byte written to it writes the dump.

    Rank 1 has no pipe reader (it is dead): opening its pipe fails with ENXIO, as the
    harness recorded."""

    def __init__(self, proc: ProcTree, pid: int, rank: int, dump: bytes) -> None:
        root = os.path.join(proc.root, str(pid), "root")
        self.pipe = root + f"{PIPE_PREFIX}{rank}.pipe"
        self.dump_path = root + f"{DUMP_PREFIX}{rank}"
        self.dump = dump
        self.triggered = 0
        os.makedirs(os.path.dirname(self.pipe), exist_ok=True)
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        os.close(self._fd)


def pyspy_dumps() -> Iterator[str]:
    """The survivor's two recorded `py-spy dump --native` texts, 5 s apart."""
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
