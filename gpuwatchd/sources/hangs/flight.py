"""PyTorch's flight recorder: find, trigger and read a rank's dump, safely.

Every ProcessGroupNCCL keeps a ring of its recent collectives (on by default,
`TORCH_FR_BUFFER_SIZE` / `TORCH_NCCL_TRACE_BUFFER_SIZE` entries). A job that sets
`TORCH_NCCL_DEBUG_INFO_PIPE_FILE` dumps it when anything is written to
`<that prefix><rank>.pipe`; a timed-out job dumps it on its own
(`TORCH_NCCL_DUMP_ON_TIMEOUT`). The dump goes to `<TORCH_NCCL_DEBUG_INFO_TEMP_FILE
or TORCH_FR_DUMP_TEMP_FILE><rank>` (a pickle; `dump_json` writes the same keys as
JSON). Paths are the rank's own, so they are read through /proc/PID/root.

The pickle is read by an unpickler that resolves no global but the three list
builders libtorch's pickler emits for typed lists; anything else is refused, so a
hostile file cannot run code. Per process group the summary gives the last
collective sequence id each rank reached and the ranks that never entered the
collective the others wait in.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatchd.errors import FlightError
from gpuwatchd.jobview import GroupProgress

__all__ = [
    "FlightEntry",
    "FlightError",
    "GroupProgress",
    "dump_path",
    "parse_dump",
    "pipe_path",
    "progress",
    "read_dump",
    "read_dumps",
    "trigger",
]

MAX_DUMP_BYTES = 64 << 20
DEFAULT_TEMP_PREFIX = "/tmp/nccl_trace_rank_"
_TEMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_PIPE_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
FLIGHT_ENV_KEYS = (*_TEMP_VARS, _PIPE_VAR)


@dataclass(frozen=True, slots=True)
class FlightEntry:
    """One recorded collective of one rank."""

    pg: str  # process group name
    seq: int  # collective_seq_id (p2p ops: p2p_seq_id)
    op: str  # profiling_name, e.g. nccl:all_reduce
    state: str  # scheduled | started | completed
    p2p: bool = False


def _list(*items: object) -> list[object]:
    return list(items[0]) if len(items) == 1 and isinstance(items[0], list | tuple) else []


class _SafeUnpickler(pickle.Unpickler):
    """Resolves libtorch's typed-list builders to `list`; every other global is refused."""

    ALLOWED = {
        ("torch.jit._pickle", "build_intlist"),
        ("torch.jit._pickle", "build_doublelist"),
        ("torch.jit._pickle", "build_boollist"),
        ("torch.jit._pickle", "build_stringlist"),
        ("torch._utils", "_rebuild_list"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self.ALLOWED:
            return _list
        raise pickle.UnpicklingError(f"global {module}.{name} refused")

    def persistent_load(self, pid: object) -> object:
        raise pickle.UnpicklingError("persistent ids refused")


def parse_dump(data: bytes) -> dict[str, object]:
    """The dump as a dict (JSON or pickle); FlightError when it is neither or unsafe."""
    if len(data) > MAX_DUMP_BYTES:
        raise FlightError("flight recorder dump too large")
    head = data.lstrip()[:1]
    try:
        doc = json.loads(data) if head in (b"{", b"[") else _SafeUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError) as e:
        raise FlightError(f"flight recorder dump unreadable: {e}") from e
    if not isinstance(doc, dict):
        raise FlightError("flight recorder dump is not a dict")
    return {str(k): v for k, v in doc.items()}


def _entries(doc: Mapping[str, object]) -> list[FlightEntry]:
    out = []
    raw = doc.get("entries")
    for e in raw if isinstance(raw, list) else ():
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, list | tuple) and pg else str(e.get("pg_id", "?"))
        p2p = e.get("is_p2p") is True
        seq = e.get("p2p_seq_id" if p2p else "collective_seq_id")
        out.append(
            FlightEntry(
                pg=name,
                seq=seq if isinstance(seq, int) else -1,
                op=str(e.get("profiling_name", "")),
                state=str(e.get("state", "")),
                p2p=p2p,
            )
        )
    return out


def progress(dumps: Mapping[int, Mapping[str, object]]) -> list[GroupProgress]:
    """Per process group: each rank's last collective, and who did not join the one waited in."""
    by_pg: dict[str, dict[int, FlightEntry]] = {}
    for rank, doc in dumps.items():
        for e in _entries(doc):
            if e.p2p or e.seq < 0:
                continue
            seen = by_pg.setdefault(e.pg, {}).get(rank)
            if seen is None or e.seq >= seen.seq:
                by_pg[e.pg][rank] = e
    out = []
    for pg, last in sorted(by_pg.items()):
        reached = {r: (e.seq, e.op, e.state) for r, e in last.items()}
        pending = [e for e in last.values() if e.state != "completed"]
        if not pending:
            out.append(GroupProgress(pg, reached))
            continue
        top = max(pending, key=lambda e: e.seq)
        behind = tuple(sorted(r for r, e in last.items() if e.seq < top.seq))
        other = tuple(sorted(r for r, e in last.items() if e.seq == top.seq and e.op != top.op))
        out.append(GroupProgress(pg, reached, (top.seq, top.op), behind, other))
    return out


# --- the files of a running rank ---------------------------------------------------


def _root(pid: int, procfs: str) -> str:
    return f"{procfs}/{pid}/root"


def dump_path(pid: int, rank: int, env: Mapping[str, str], procfs: str = "/proc") -> str:
    """Where the rank writes its dump, seen from here (through its root)."""
    prefix = next((env[k] for k in _TEMP_VARS if env.get(k)), DEFAULT_TEMP_PREFIX)
    return _root(pid, procfs) + os.path.join("/", prefix + str(rank))


def pipe_path(pid: int, rank: int, env: Mapping[str, str], procfs: str = "/proc") -> str | None:
    """The rank's dump trigger pipe, if the job set one."""
    prefix = env.get(_PIPE_VAR, "")
    return _root(pid, procfs) + os.path.join("/", f"{prefix}{rank}.pipe") if prefix else None


def trigger(path: str) -> bool:
    """Ask a rank to dump: one byte into its pipe, never blocking (False: nobody reads)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, b"1")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_dump(path: str, not_before: float = 0.0) -> dict[str, object]:
    """Read and parse one dump file written after `not_before` (the rank's start: an older
    file is another job's); FlightError when absent, stale or unreadable."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_mtime < not_before:
                raise FlightError(f"the dump at {path} is older than the rank")
            data = f.read(MAX_DUMP_BYTES + 1)
    except OSError as e:
        raise FlightError(f"no flight recorder dump at {path}: {e.strerror}") from e
    return parse_dump(data)


def read_dumps(
    paths: Iterable[tuple[int, str, float]],
) -> tuple[dict[int, dict[str, object]], list[str]]:
    """(rank -> dump, problems) for every (rank, path, not_before) given."""
    dumps: dict[int, dict[str, object]] = {}
    problems = []
    for rank, path, not_before in paths:
        try:
            dumps[rank] = read_dump(path, not_before)
        except FlightError as e:
            problems.append(f"rank {rank}: {e}")
    return dumps, problems
