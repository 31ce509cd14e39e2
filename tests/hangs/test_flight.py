"""The flight recorder reader: libtorch-shaped pickles (typed lists through the builders
libtorch's pickler names), JSON dumps, refusal of any other global, the per-group
summary, and the pipe trigger on a real FIFO."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import types
from pathlib import Path

import pytest

from gpuwatchd.sources.hangs import flight


def _entry(seq: int, op: str, state: str, pg: str = "0") -> dict[str, object]:
    return {
        "record_id": seq,
        "pg_id": 0,
        "process_group": (pg, "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": 1_000 * seq,
        "state": state,
        "is_p2p": False,
        "retired": state == "completed",
    }


def _dump(entries: list[dict[str, object]]) -> dict[str, object]:
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {"0": {"last_enqueued_collective": "51"}},
        "entries": entries,
    }


def _libtorch_pickle(doc: dict[str, object]) -> bytes:
    """Pickle as libtorch does: int lists through torch.jit._pickle.build_intlist."""
    mod = types.ModuleType("torch.jit._pickle")

    def build_intlist(data: list[int]) -> list[int]:
        return data

    build_intlist.__module__ = "torch.jit._pickle"
    build_intlist.__qualname__ = "build_intlist"
    mod.build_intlist = build_intlist  # type: ignore[attr-defined]

    class IntList(list):  # type: ignore[type-arg]
        def __reduce__(self) -> tuple[object, tuple[list[int]]]:
            return build_intlist, (list(self),)

    for e in doc["entries"]:  # type: ignore[attr-defined]
        e["input_sizes"] = [IntList([32, 128])]
    names = ("torch", "torch.jit", "torch.jit._pickle")
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({n: types.ModuleType(n) for n in names[:2]}, **{names[2]: mod})
    try:
        return pickle.dumps(doc, protocol=2)
    finally:  # the reader must not need torch: it is gone again before loading
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def test_unbalanced_collectives_name_the_step_and_the_ranks_there() -> None:
    rank0 = [_entry(s, "all_reduce", "completed") for s in range(1, 51)]
    rank0.append(_entry(51, "all_reduce", "started"))  # one extra all_reduce
    rank1 = [_entry(s, "all_reduce", "completed") for s in range(1, 51)]
    rank1.append(_entry(51, "all_gather", "started"))  # moved on to an all_gather
    data0, data1 = _libtorch_pickle(_dump(rank0)), _libtorch_pickle(_dump(rank1))
    assert b"build_intlist" in data0 and "torch" not in sys.modules
    dumps = {0: flight.parse_dump(data0), 1: flight.parse_dump(data1)}
    assert dumps[0]["entries"][0]["input_sizes"] == [[32, 128]]  # type: ignore[index]
    (pg,) = flight.progress(dumps)
    assert pg.reached == {
        0: (51, "nccl:all_reduce", "started"),
        1: (51, "nccl:all_gather", "started"),
    }
    assert pg.not_joined == () and pg.ops_differ in ((0,), (1,))
    assert "rank 0 at #51 nccl:all_reduce (started)" in pg.line()
    assert "in another collective at that step" in pg.line()


def test_a_rank_that_never_joined_the_collective_the_others_wait_in() -> None:
    waiting = [_entry(s, "all_reduce", "completed") for s in range(1, 52)]
    waiting.append(_entry(52, "all_reduce", "started"))
    behind = [_entry(s, "all_reduce", "completed") for s in range(1, 52)]
    doc = json.dumps(_dump(waiting)).encode()  # the JSON dump has the same keys
    dumps = {0: flight.parse_dump(doc), 1: flight.parse_dump(_libtorch_pickle(_dump(behind)))}
    (pg,) = flight.progress(dumps)
    assert pg.waiting_in == (52, "nccl:all_reduce") and pg.not_joined == (1,)
    assert pg.line().endswith("not joined nccl:all_reduce #52: rank 1")


def test_any_other_global_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {marker}",)

    with pytest.raises(flight.FlightError, match="refused"):
        flight.parse_dump(pickle.dumps({"entries": [Evil()]}))
    assert not marker.exists()
    with pytest.raises(flight.FlightError):
        flight.parse_dump(b"\x80\x02not a pickle")
    with pytest.raises(flight.FlightError, match="not a dict"):
        flight.parse_dump(b"[1, 2]")


def test_paths_through_the_ranks_root_and_the_pipe_trigger(tmp_path: Path) -> None:
    env = {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/scratch/pipe_",
    }
    assert flight.dump_path(42, 3, env, str(tmp_path)) == f"{tmp_path}/42/root/scratch/fr_3"
    assert flight.dump_path(42, 3, {}, "/proc") == "/proc/42/root/tmp/nccl_trace_rank_3"
    assert flight.pipe_path(42, 3, {}, "/proc") is None
    pipe = flight.pipe_path(42, 3, env, str(tmp_path))
    assert pipe == f"{tmp_path}/42/root/scratch/pipe_3.pipe"
    os.makedirs(os.path.dirname(pipe))
    os.mkfifo(pipe)
    assert not flight.trigger(pipe)  # nobody reads: never blocks
    got: list[bytes] = []
    ready = threading.Event()

    def reader() -> None:
        fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        ready.set()
        for _ in range(200):
            try:
                data = os.read(fd, 16)
            except BlockingIOError:
                data = b""
            if data:
                got.append(data)
                break
            threading.Event().wait(0.01)
        os.close(fd)

    t = threading.Thread(target=reader)
    t.start()
    ready.wait(5)
    assert flight.trigger(pipe)
    t.join(5)
    assert got == [b"1"]
    dump = tmp_path / "dump_0"
    dump.write_bytes(json.dumps(_dump([_entry(1, "barrier", "completed")])).encode())
    old = tmp_path / "dump_2"  # left by an earlier job: older than the rank
    old.write_bytes(dump.read_bytes())
    os.utime(old, (1.0, 1.0))
    dumps, problems = flight.read_dumps(
        [(0, str(dump), 0.0), (1, str(tmp_path / "none"), 0.0), (2, str(old), 100.0)]
    )
    assert list(dumps) == [0] and problems[0].startswith("rank 1: no flight recorder dump")
    assert "older than the rank" in problems[1]


def test_forensics_read_each_ranks_dump_through_its_root_and_name_the_signature(
    tmp_path: Path,
) -> None:
    from gpuwatchd.forensics import NodeForensics
    from gpuwatchd.health.hangs.detector import JobVerdict
    from gpuwatchd.health.hangs.signatures import builtin_catalog
    from gpuwatchd.health.hangs.summary import summarize
    from gpuwatchd.jobview import JobView, RankView

    ops = {0: "all_reduce", 1: "all_gather"}  # rank 1 moved on to an all_gather
    for pid, rank in ((100, 0), (101, 1)):
        d = tmp_path / str(pid)
        (d / "root" / "scratch").mkdir(parents=True)
        (d / "environ").write_bytes(b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/scratch/fr_\0")
        entries = [_entry(s, "all_reduce", "completed") for s in range(1, 51)]
        entries.append(_entry(51, ops[rank], "started"))
        (d / "root" / "scratch" / f"fr_{rank}").write_bytes(_libtorch_pickle(_dump(entries)))
    ranks = tuple(
        RankView(pid, (str(r),), r, state="S", age_seconds=60.0) for pid, r in ((100, 0), (101, 1))
    )
    job = JobView("j", ranks, 2, 2)
    waited: list[float] = []
    groups, problems = NodeForensics().flight(job, str(tmp_path), waited.append)
    assert problems == [] and waited == []  # no pipe set: nothing triggered, nothing waited
    (g,) = groups
    assert g.reached[1] == (51, "nccl:all_gather", "started") and g.ops_differ
    verdict = JobVerdict("j", ("collective_stall",), 0.0, "ras", severity="critical")
    s = summarize(job, verdict, {}, None, builtin_catalog(), {"flight:ops_differ"})
    assert s.signature is not None and s.signature.name == "ranks_in_different_collectives"
