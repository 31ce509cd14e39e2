"""The NCCL RAS client against a replay server on a real TCP socket, with answers
recorded from NCCL 2.28.9 (PyTorch 2.11) on an H100."""

from __future__ import annotations

import json
import socket
import time

import pytest

from gpuwatchd.sources.hangs import ras
from tests.hangs.ras_server import ras_server
from tests.hangs.replay import fixture


def test_json_status_of_a_running_one_rank_job() -> None:
    with ras_server(fixture("ras-running.txt"), fixture("ras-running.json")) as srv:
        answer = ras.query(srv.addr, timeout=5)
    assert srv.requests[0] == ["CLIENT PROTOCOL 2", "TIMEOUT 5", "SET FORMAT json", "STATUS"]
    assert answer.server_protocol == 2
    rep = answer.report
    assert rep is not None and rep.nccl_version == "2.28.9"
    (comm,) = rep.communicators
    assert comm.size == 1 and comm.missing_ranks == ()
    (rank,) = comm.ranks
    assert (rank.rank, rank.cuda_dev, rank.nvml_dev, rank.init_state) == (0, 0, 0, 0)
    assert not (rank.destroy_flag or rank.abort_flag or rank.finalize_called)
    assert rank.collective_counts["AllReduce"] == 0
    assert rep.extra["timestamp"]  # fields we do not model are kept


def test_verbose_text_status() -> None:
    with ras_server(fixture("ras-running.txt"), fixture("ras-running.json")) as srv:
        answer = ras.query(srv.addr, fmt="text", verbose=True, timeout=5)
    assert srv.requests[0][-1] == "VERBOSE STATUS"
    assert "SET FORMAT json" not in srv.requests[0]
    assert answer.report is None and "RUNNING" in answer.text


def test_after_destroy_and_after_abort_the_communicator_is_gone() -> None:
    for name in ("ras-after-destroy", "ras-after-abort"):
        with ras_server(fixture(f"{name}.txt"), fixture(f"{name}.json")) as srv:
            rep = ras.query(srv.addr, timeout=5).report
        assert rep is not None and rep.communicators == ()
        assert "No communicator data collected" in fixture(f"{name}.txt")


def test_newer_fields_are_used_when_present_and_never_required() -> None:
    doc = json.loads(fixture("ras-running.json"))
    rank = doc["communicators"][0]["ranks"][0]
    rank["status"]["destroy_flag"] = True
    rank["progress"] = {"device_ops": 12}  # a field a newer NCCL might add
    doc["communicators"][0]["missing_ranks"] = [{"rank": 1, "host": "10.0.0.2", "pid": 77}]
    rep = ras.parse_report(json.dumps(doc))
    (comm,) = rep.communicators
    assert comm.ranks[0].destroy_flag and comm.ranks[0].extra["progress"] == {"device_ops": 12}
    assert rep.missing() == [(comm.hash, {"rank": 1, "host": "10.0.0.2", "pid": 77})]
    bare = ras.parse_report('{"communicators": [{"ranks": [{"rank": 3}]}]}')
    assert bare.communicators[0].ranks[0].rank == 3 and bare.nccl_version == ""


def test_a_wedged_server_is_bounded_by_the_timeout() -> None:
    with ras_server("", "", stall=True) as srv:
        start = time.monotonic()
        with pytest.raises(ras.RasError, match="timed out"):
            ras.query(srv.addr, timeout=0.5)
        assert time.monotonic() - start < 2.0


def test_nothing_listening_is_a_clear_error() -> None:
    with socket.socket() as s:  # bound, never listening: connection refused
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ras.RasError, match="cannot connect to RAS"):
            ras.query(addr, timeout=1)


@pytest.mark.parametrize(
    ("addr", "want"),
    [
        ("localhost:28028", ("localhost", 28028)),
        ("10.0.0.5:29000", ("10.0.0.5", 29000)),
        ("[::1]:28030", ("::1", 28030)),
        ("myhost", ("myhost", 28028)),
        (":29001", ("localhost", 29001)),
    ],
)
def test_parse_addr(addr: str, want: tuple[str, int]) -> None:
    assert ras.parse_addr(addr) == want


def test_bad_answers_are_errors_not_crashes() -> None:
    with pytest.raises(ras.RasError):
        ras.parse_report("not json")
    with pytest.raises(ras.RasError):
        ras.parse_report("[1, 2]")


def test_query_from_a_child_in_the_network_namespace_of_a_process() -> None:
    """The child joins the namespace of a process (here our own) before asking."""
    import os

    with ras_server(fixture("ras-running.txt"), fixture("ras-running.json")) as srv:
        try:
            answer = ras.query_in_netns(os.getpid(), srv.addr, timeout=10)
        except ras.RasError as e:
            if "Operation not permitted" in str(e):
                pytest.skip("no CAP_SYS_ADMIN here")
            raise
    assert answer.report is not None and answer.report.nccl_version == "2.28.9"
    with pytest.raises(ras.RasError, match="network namespace of pid|No such file"):
        ras.query_in_netns(2**22 + 7, "127.0.0.1:1", timeout=2)
