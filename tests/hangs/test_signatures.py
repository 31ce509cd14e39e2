"""Signatures and the cross-rank summary from real py-spy dumps and RAS answers (H100).

The rendezvous and dead-peer stacks are py-spy dumps recorded on an H100;
the teardown, abort, different-collective and data-loader cases are built
from the frame names those hangs show (see docs/hangs.md), since the single
GPU of the test machine did not reproduce them.
"""

from __future__ import annotations

import json

import pytest

from gpuwatchd.errors import ConfigError
from gpuwatchd.health.hangs.detector import JobVerdict
from gpuwatchd.health.hangs.signatures import builtin_catalog, load_catalog
from gpuwatchd.health.hangs.summary import summarize
from gpuwatchd.sources.hangs.jobs import JobView, RankView
from gpuwatchd.sources.hangs.ras import parse_report
from gpuwatchd.sources.hangs.stacks import StackCapture, parse_dump
from tests.hangs.replay import fixture


def _capture(pid: int, text: str) -> StackCapture:
    version, threads = parse_dump(text)
    return StackCapture(pid, True, threads, python=version, raw=text)


def _verdict(
    job: str, conditions: tuple[str, ...], states: dict[int, str], **kw: object
) -> JobVerdict:
    return JobVerdict(job, conditions, 0.0, "gpm", rank_states=tuple(states.items()), **kw)  # type: ignore[arg-type]


def test_py_spy_dump_parses_into_threads_and_frames() -> None:
    version, threads = parse_dump(fixture("pyspy-rendezvous.txt"))
    assert version.startswith("3.12.3")
    (main,) = threads
    assert (main.thread_id, main.name, main.state) == ("962", "MainThread", "idle")
    assert main.frames[2].function == "c10d::TCPStore::waitForWorkers"
    assert main.frames[2].location == "libtorch_cpu.so"
    assert main.frames[-2].text() == "main (tests/gpu/hang_jobs.py:153)" or any(
        f.function == "rendezvous" for f in main.frames
    )


def test_rank_missing_at_start_matches_rendezvous_from_the_real_stack() -> None:
    job = JobView("torch:127.0.0.1:29533", (RankView(962, ("0",), 0, 0, 2),), 2, 2)
    v = _verdict(job.job, ("rank_missing",), {962: "idle"}, missing_count=1)
    s = summarize(
        job, v, {962: _capture(962, fixture("pyspy-rendezvous.txt"))}, None, builtin_catalog()
    )
    assert s.signature is not None and s.signature.name == "rendezvous_missing_rank"
    assert s.ranks[0].where == "c10d::TCPStore::waitForWorkers"
    assert s.missing == ("1 rank(s) never started",)
    assert "MASTER_ADDR:MASTER_PORT" in s.signature.remediation


def test_a_rank_that_never_started_is_the_rendezvous_without_stacks() -> None:
    # defaults (no stacks): rank 0 of WORLD_SIZE=2 alone at start-up, as on 4x H200
    job = JobView("torch:127.0.0.1:29603", (RankView(1723, ("2",), 0, 0, 2),), 2, 2)
    v = _verdict(job.job, ("rank_missing",), {1723: "idle"}, missing_count=1)
    s = summarize(job, v, {}, None, builtin_catalog())
    assert "ranks:never_started" in s.facts
    assert s.signature is not None and s.signature.name == "rendezvous_missing_rank"


def test_peer_death_matches_dead_peer_from_the_real_stack() -> None:
    job = JobView("torch:127.0.0.1:29544", (RankView(1031, ("0",), 0, 0, 2),), 2, 2)
    v = _verdict(job.job, ("rank_missing",), {1031: "spin"}, missing_ranks=(1,), missing_count=1)
    caps = {1031: _capture(1031, fixture("pyspy-peerdeath.txt"))}
    s = summarize(job, v, caps, None, builtin_catalog())
    assert s.signature is not None and s.signature.name == "straggler_or_dead_peer"
    assert s.ranks[0].where == "cuCtxSynchronize_v2"
    assert s.where_line() == "rank 0 (pid 1031): cuCtxSynchronize_v2; rank 1: missing"


TEARDOWN = """Thread 500 (idle): "MainThread"
    ncclCommPollCallbacks (libnccl.so.2)
    ncclCommDestroy (libnccl.so.2)
    c10d::ProcessGroupNCCL::shutdown (libtorch_cuda.so)
    destroy_process_group (torch/distributed/distributed_c10d.py:2199)
    main (train.py:88)
"""


def test_teardown_from_stacks_or_from_the_ras_destroy_flag() -> None:
    job = JobView("j", (RankView(500, ("0",), 0, 0, 1),), 1, 1)
    v = _verdict("j", ("cpu_stall",), {500: "idle"})
    s = summarize(job, v, {500: _capture(500, TEARDOWN)}, None, builtin_catalog())
    assert s.signature is not None and s.signature.name == "teardown_graph_holds_communicator"
    doc = json.loads(fixture("ras-running.json"))
    doc["communicators"][0]["ranks"][0]["status"]["destroy_flag"] = True
    doc["communicators"][0]["ranks"][0]["pid"] = 500
    s = summarize(job, v, {}, parse_report(json.dumps(doc)), builtin_catalog())
    assert "ras:destroying" in s.facts
    assert s.signature is not None and s.signature.name == "teardown_graph_holds_communicator"


def test_abort_flag_from_ras_names_the_watchdog_abort() -> None:
    job = JobView("j", (RankView(417, ("0",), 0, 0, 1),), 1, 1)
    doc = json.loads(fixture("ras-running.json"))
    doc["communicators"][0]["ranks"][0]["status"]["abort_flag"] = True
    doc["communicators"][0]["ranks"][0]["pid"] = 417
    s = summarize(
        job,
        _verdict("j", ("gpu_stall",), {417: "spin"}),
        {},
        parse_report(json.dumps(doc)),
        builtin_catalog(),
    )
    assert s.signature is not None and s.signature.name == "nccl_watchdog_abort"


def _stack(pid: int, *frames: str) -> StackCapture:
    body = "\n".join(f"    {f}" for f in frames)
    return _capture(pid, f'Thread {pid} (active): "MainThread"\n{body}\n')


def test_ranks_in_different_collectives_and_the_first_diverging_frame() -> None:
    ranks = (RankView(1, ("0",), 0, 0, 2), RankView(2, ("1",), 1, 1, 2))
    job = JobView("j", ranks, 2, 2)
    caps = {
        1: _stack(
            1,
            "ncclAllReduce (libnccl.so.2)",
            "all_reduce (torch/distributed/distributed_c10d.py:2800)",
            "step (train.py:40)",
            "main (train.py:90)",
        ),
        2: _stack(
            2,
            "ncclBroadcast (libnccl.so.2)",
            "broadcast (torch/distributed/distributed_c10d.py:2600)",
            "maybe_sync (train.py:55)",
            "main (train.py:91)",
        ),
    }
    s = summarize(
        job, _verdict("j", ("gpu_stall",), {1: "spin", 2: "spin"}), caps, None, builtin_catalog()
    )
    assert s.signature is not None and s.signature.name == "ranks_in_different_collectives"
    assert s.diverging_frame == "main (train.py:90) | main (train.py:91)"
    assert [r.collective for r in s.ranks] == ["ncclAllReduce", "ncclBroadcast"]


def test_collective_counts_that_diverge_in_ras() -> None:
    doc = json.loads(fixture("ras-running.json"))
    comm = doc["communicators"][0]
    r0 = comm["ranks"][0]
    r1 = json.loads(json.dumps(r0))
    r1.update(rank=1, pid=418)
    r0["pid"] = 417
    r0["collective_counts"]["AllReduce"] = 120
    r1["collective_counts"]["AllReduce"] = 119
    comm["ranks"] = [r0, r1]
    job = JobView("j", (RankView(417, ("0",), 0), RankView(418, ("1",), 1)), 2, 2)
    s = summarize(
        job,
        _verdict("j", ("gpu_stall",), {417: "spin", 418: "spin"}),
        {},
        parse_report(json.dumps(doc)),
        builtin_catalog(),
    )
    assert "ras:counts_diverge" in s.facts
    assert s.signature is not None and s.signature.name == "ranks_in_different_collectives"
    assert [dict(r.collective_counts)["AllReduce"] for r in s.ranks] == [120, 119]


def test_data_loader_wait() -> None:
    job = JobView("j", (RankView(9, ("0",), 0, 0, 2),), 1, 2)
    cap = _stack(
        9,
        "poll (libc.so.6)",
        "_poll (multiprocessing/connection.py:440)",
        "get (multiprocessing/queues.py:113)",
        "_try_get_data (torch/utils/data/dataloader.py:1284)",
        "__next__ (torch/utils/data/dataloader.py:733)",
        "train (train.py:20)",
    )
    s = summarize(
        job, _verdict("j", ("cpu_stall",), {9: "idle"}), {9: cap}, None, builtin_catalog()
    )
    assert s.signature is not None and s.signature.name == "dataloader_wait"


def test_one_rank_elsewhere_while_the_others_share_a_collective() -> None:
    ranks = tuple(RankView(p, (str(p),), p, p, 3) for p in (0, 1, 2))
    caps = {
        0: _stack(0, "all_reduce (torch/distributed/distributed_c10d.py:2800)", "main (t.py:1)"),
        1: _stack(1, "all_reduce (torch/distributed/distributed_c10d.py:2800)", "main (t.py:1)"),
        2: _stack(2, "save (torch/serialization.py:900)", "main (t.py:2)"),
    }
    v = _verdict("j", ("straggler",), {0: "spin", 1: "spin", 2: "busy"})
    s = summarize(JobView("j", ranks, 3, 3), v, caps, None, builtin_catalog())
    assert "stacks:one_rank_elsewhere" in s.facts
    assert s.signature is not None and s.signature.name == "straggler"
    assert s.signatures[-2:] == ("straggler_or_dead_peer", "unclassified_stall")


def test_no_signature_unless_suspected_and_a_fallback_otherwise() -> None:
    job = JobView("j", (RankView(1, ("0",), 0),))
    assert (
        summarize(job, _verdict("j", (), {1: "busy"}), {}, None, builtin_catalog()).signature
        is None
    )
    s = summarize(job, _verdict("j", ("gpu_stall",), {1: "spin"}), {}, None, builtin_catalog())
    assert s.signature is not None and s.signature.name == "unclassified_stall"


def test_every_builtin_signature_has_remediation_and_a_known_severity() -> None:
    names = [s.name for s in builtin_catalog()]
    assert len(names) == len(set(names)) >= 7
    for s in builtin_catalog():
        assert len(s.remediation) > 80 and s.severity in ("warning", "critical")


def test_site_file_replaces_by_name_and_puts_new_ones_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    site = tmp_path / "hangs.yaml"
    site.write_text(
        "signatures:\n"
        "  - name: dataloader_wait\n    severity: critical\n    remediation: call storage on-call\n"
        "    when: [{frames: ['_try_get_data']}]\n"
        "  - name: our_allreduce_bug\n    remediation: upgrade our fork\n"
        "    when: [{frames: ['our_allreduce']}]\n"
    )
    cat = load_catalog(str(site))
    assert cat[0].name == "our_allreduce_bug"
    by = {s.name: s for s in cat}
    assert by["dataloader_wait"].remediation == "call storage on-call"
    assert [s.name for s in cat].index("dataloader_wait") == 7


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("signatures: 3\n", "signatures"),
        ("signatures:\n  - name: x\n    when: []\n", "no alternative"),
        ("signatures:\n  - name: x\n    severity: fatal\n    when: [{facts: []}]\n", "severity"),
        ("signatures:\n  - name: x\n    when: [{frames: ['(']}]\n", "bad frame pattern"),
    ],
)
def test_bad_site_files_name_the_file_and_problem(tmp_path, text: str, problem: str) -> None:  # type: ignore[no-untyped-def]
    site = tmp_path / "bad.yaml"
    site.write_text(text)
    with pytest.raises(ConfigError, match=problem) as e:
        load_catalog(str(site))
    assert str(site) in str(e.value)


def test_ranks_of_other_nodes_name_the_rendezvous_and_wait_without_stacks() -> None:
    from gpuwatchd.health.hangs.alerts import role_of

    job = JobView("torch:127.0.0.1:29603", (RankView(1448, ("0",), 0, 0, 4),), 1, 4)
    v = _verdict(
        job.job, ("rank_missing",), {1448: "waiting"}, missing_count=3, elsewhere=(1, 2, 3)
    )
    s = summarize(job, v, {}, None, builtin_catalog())
    assert s.signature is not None and s.signature.name == "rendezvous_missing_rank"
    assert "ranks:not_arrived" in s.facts and "ranks:never_started" not in s.facts
    assert s.missing == ("ranks 1-3 (expected on other nodes)",)
    assert "other nodes" in s.signature.remediation
    assert role_of(v) == "waiting"  # the culprits are elsewhere


def test_a_kernel_that_never_completes_from_the_real_stack() -> None:
    job = JobView("torch:127.0.0.1:29655", (RankView(1031, ("0",), 0, 0, 1),), 1, 1)
    v = _verdict(job.job, ("kernel_stuck",), {1031: "waiting"})
    s = summarize(
        job, v, {1031: _capture(1031, fixture("pyspy-peerdeath.txt"))}, None, builtin_catalog()
    )
    assert s.signature is not None and s.signature.name == "kernel_never_completes"
    assert s.signature.severity == "critical"
    assert "cuda-gdb" in s.signature.remediation and "nvidia-smi -r" in s.signature.remediation
    # the same stack under the generic GPU stall keeps its old name: no fact, no signature
    generic = summarize(
        job,
        _verdict(job.job, ("gpu_stall",), {1031: "waiting"}),
        {1031: _capture(1031, fixture("pyspy-peerdeath.txt"))},
        None,
        builtin_catalog(),
    )
    assert generic.signature is not None and generic.signature.name == "unclassified_stall"
