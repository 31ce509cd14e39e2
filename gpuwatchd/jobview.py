"""What the hang detector sees of a job, and what forensics bring back.

The job and rank views are built by the sources (from /proc, NVML and the
workloads source); stack captures come from py-spy and answers from NCCL's RAS
service. The health layer decides on these values and never does that I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatchd.errors import RasError

__all__ = [
    "DEFAULT_RAS_ADDR",
    "Frame",
    "GroupProgress",
    "JobView",
    "RankView",
    "RasAnswer",
    "RasCommunicator",
    "RasError",
    "RasRank",
    "RasReport",
    "StackCapture",
    "ThreadStack",
    "gpu_order",
]

DEFAULT_RAS_ADDR = "localhost:28028"


@dataclass(frozen=True, slots=True)
class RankView:
    """One process of a job on this node."""

    pid: int
    gpus: tuple[str, ...]
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    cpu_seconds: float | None = None  # user+system of all threads; None = unreadable
    ras_addr: str = DEFAULT_RAS_ADDR
    command: str = ""
    # From the hang path's own /proc probe (sources/hangs/proc.py); None = not read.
    state: str = ""  # /proc state letter; "gone" once the process has left
    io_bytes: int | None = None  # rchar + wchar: every byte read or written, files or sockets
    child_cpu_seconds: float | None = None  # its children (data-loader workers, compilers)
    child_io_bytes: int | None = None
    age_seconds: float | None = None  # since the process started

    @property
    def alive(self) -> bool:
        """False once the process has gone or is a zombie waiting to be reaped."""
        return self.state not in ("gone", "Z", "X")


@dataclass(frozen=True, slots=True)
class JobView:
    """A job's processes on this node and what they expect.

    `expected_local` is how many ranks should run here (LOCAL_WORLD_SIZE,
    or WORLD_SIZE for a single-node job); None = unknown. `labels` carries
    job / namespace / pod / slurm_job for alerts (never metrics).
    """

    job: str
    ranks: tuple[RankView, ...]
    expected_local: int | None = None
    world_size: int | None = None
    labels: tuple[tuple[str, str], ...] = ()
    ras_addr: str = DEFAULT_RAS_ADDR
    collective_timeout_seconds: float | None = None  # what the job declares, if readable

    @property
    def gpus(self) -> tuple[str, ...]:
        """Every GPU any rank of the job uses, sorted."""
        return tuple(sorted({g for r in self.ranks for g in r.gpus}, key=gpu_order))


def gpu_order(gpu: str) -> tuple[int, str]:
    """Sort key for GPU names: numeric indexes in order, then the rest."""
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame: function and `file:line` (or the library, for native frames)."""

    function: str
    location: str = ""

    def text(self) -> str:
        """`function (location)`, as py-spy prints it; what signatures match."""
        return f"{self.function} ({self.location})" if self.location else self.function


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread: innermost frame first."""

    thread_id: str
    name: str
    state: str
    frames: tuple[Frame, ...]


@dataclass(frozen=True, slots=True)
class StackCapture:
    """One process's stacks, or why there are none."""

    pid: int
    ok: bool
    threads: tuple[ThreadStack, ...] = ()
    error: str = ""
    python: str = ""
    seconds: float = 0.0
    raw: str = ""

    def main_thread(self) -> ThreadStack | None:
        """The thread py-spy calls MainThread, else the first one."""
        for t in self.threads:
            if t.name == "MainThread":
                return t
        return self.threads[0] if self.threads else None


@dataclass(frozen=True, slots=True)
class RasRank:
    """One rank of a communicator as RAS reports it."""

    rank: int
    host: str = ""
    pid: int | None = None
    cuda_dev: int | None = None
    nvml_dev: int | None = None
    init_state: int = 0
    async_error: int = 0
    finalize_called: bool = False
    destroy_flag: bool = False
    abort_flag: bool = False
    collective_counts: Mapping[str, int] = field(default_factory=dict)
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RasCommunicator:
    """One communicator: its ranks, and those RAS could not reach."""

    hash: str
    size: int
    ranks: tuple[RasRank, ...]
    missing_ranks: tuple[Mapping[str, object], ...] = ()
    missing_ranks_count: int = 0
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RasReport:
    """A parsed JSON `STATUS` answer."""

    nccl_version: str
    communicators: tuple[RasCommunicator, ...]
    timeouts_count: int = 0
    collection_time_seconds: float | None = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def missing(self) -> list[tuple[str, Mapping[str, object]]]:
        """(communicator hash, missing rank entry) for every rank RAS could not reach."""
        return [(c.hash, m) for c in self.communicators for m in c.missing_ranks]


@dataclass(frozen=True, slots=True)
class RasAnswer:
    """What one query brought back: the raw text and, for JSON, the parsed report."""

    addr: str
    server_protocol: int
    text: str
    report: RasReport | None
    seconds: float


@dataclass(frozen=True, slots=True)
class GroupProgress:
    """One process group across the ranks that dumped: who reached which collective."""

    pg: str
    reached: Mapping[int, tuple[int, str, str]]  # rank -> (seq, op, state) of its last entry
    waiting_in: tuple[int, str] = (-1, "")  # the collective the others wait in
    not_joined: tuple[int, ...] = ()  # ranks that never entered it
    ops_differ: tuple[int, ...] = field(default=())  # ranks in another op at that seq

    def line(self) -> str:
        """`pg 0: rank 0 at #51 nccl:all_reduce (started); rank 1 ...; not joined: 1`."""
        parts = [f"rank {r} at #{s} {op} ({st})" for r, (s, op, st) in sorted(self.reached.items())]
        text = f"process group {self.pg}: " + "; ".join(parts)
        if self.not_joined:
            seq, op = self.waiting_in
            text += f"; not joined {op} #{seq}: rank {', '.join(map(str, self.not_joined))}"
        if self.ops_differ:
            text += (
                f"; in another collective at that step: rank {', '.join(map(str, self.ops_differ))}"
            )
        return text
