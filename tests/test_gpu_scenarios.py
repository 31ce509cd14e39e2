"""The multi-GPU scenario harness (tests/gpu/nccl_scenarios.py) without a GPU.

Its schedule must fit the device calls it is written for, and its bookkeeping
(markers, the kill, samples, the end of every child) must hold on fake ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "gpu" / "nccl_scenarios.py"


def harness(*args: str, timeout: float = 60, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)  # only where a test sets it
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(HARNESS), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_each_session_call_fits_its_budget_and_together_they_run_every_scenario() -> None:
    names: list[str] = []
    for suite in ("a", "b", "c"):
        out = harness("--plan", "--gpus", "4", suite)  # the suites are cut for 4 GPUs
        assert out.returncode == 0, out.stderr
        *rows, total = out.stdout.strip().splitlines()
        assert float(total.split("~")[1].split()[0]) <= 540, total
        names += [r.split()[-1] for r in rows]
    every = harness("--plan", "--gpus", "4", "all").stdout.strip().splitlines()[:-1]
    assert sorted(names) == sorted(r.split()[-1] for r in every)


def fake_nvidia_smi(tmp_path: Path, gpus: int) -> str:
    """A PATH whose nvidia-smi -L lists `gpus` GPUs (the first one with a MIG instance)."""
    lines = [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})" for i in range(gpus)]
    lines.insert(1, "  MIG 1g.10gb     Device  0: (UUID: MIG-00000000)")
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    exe.chmod(0o755)
    return f"{tmp_path}:{os.environ['PATH']}"


def test_scenarios_are_planned_on_the_gpus_the_machine_has(tmp_path: Path) -> None:
    out = harness("--plan", "hangs", PATH=fake_nvidia_smi(tmp_path, 2))
    assert out.returncode == 0, out.stderr
    *rows, total = out.stdout.strip().splitlines()
    assert "on 2 GPUs (nvidia-smi -L)" in total, total
    assert all("[2" not in r and ", 3]" not in r for r in rows), rows  # no GPU 2 or 3
    masked = harness("--plan", "hangs", CUDA_VISIBLE_DEVICES="3", PATH=fake_nvidia_smi(tmp_path, 4))
    *rows, total = masked.stdout.strip().splitlines()
    assert "on 1 GPUs (CUDA_VISIBLE_DEVICES)" in total, total
    one_gpu = sorted(r.split()[-1] for r in rows if "skip" not in r)
    assert one_gpu == ["kernel_never_ends", "remote_rank_missing", "rendezvous_missing"]
    assert all("needs 2 GPU(s); 1 here" in r for r in rows if "skip" in r)


@pytest.mark.slow
def test_a_scenario_wider_than_the_machine_is_skipped_not_started(tmp_path: Path) -> None:
    out = harness(
        "--dry-run",
        "--out",
        str(tmp_path),
        "--daemon-url",
        "",
        "--gpus",
        "1",
        "--hang-seconds",
        "2",
        "dead_peer",
        "rendezvous_missing",
    )
    assert out.returncode == 0, out.stderr
    rows = {
        r.get("scenario"): r for r in json.loads((tmp_path / "summary.json").read_text())["rows"]
    }
    assert rows["dead_peer"] == {"scenario": "dead_peer", "skipped": "needs 2 GPU(s); 1 here"}
    assert not (tmp_path / "dead_peer").exists()
    trace = json.loads((tmp_path / "rendezvous_missing" / "trace.json").read_text())
    assert trace["devices"] == ["0"] and "nvml" in trace
    rank = trace["samples"][-1]["ranks"]["0"]
    assert rank["alive"] and rank["task_cpu_s"] is not None  # the daemon's CPU reading too


@pytest.mark.slow
def test_a_dead_peer_on_fake_ranks_is_killed_sampled_and_cleaned_up(tmp_path: Path) -> None:
    out = harness(
        "--dry-run",
        "--out",
        str(tmp_path),
        "--daemon-url",
        "",
        "--hang-seconds",
        "3",
        "--settle",
        "1",
        "--warm",
        "0.2",
        "dead_peer",
    )
    assert out.returncode == 0, out.stderr
    trace = json.loads((tmp_path / "dead_peer" / "trace.json").read_text())
    killed = trace["ranks"]["1"]
    assert trace["hang_what"] == [f"SIGKILL rank 1 (pid {killed})"]
    assert trace["hang_start"] > trace["t_ready"]
    last = trace["samples"][-1]["ranks"]
    assert not last["1"]["alive"] and last["0"]["alive"]
    assert trace["notes"] == []  # nothing left alive after the kill
    for pid in trace["ranks"].values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert rows[0]["scenario"] == "dead_peer" and rows[0]["hang_start_s"] is not None


@pytest.mark.slow
def test_the_one_gpu_hang_recorder_runs_its_scenario_beside_a_daemon_and_writes_a_fixture(
    tmp_path: Path,
) -> None:
    """hang_daemon_e2e.py --scenario on fake ranks: the daemon (replayed NVML) and the
    harness start, the remote rank-missing job runs with LOCAL_WORLD_SIZE=1 and its peer
    never starts, the recording becomes a fixture whose expect.json asks for the early
    stacks; the JSON has the timing keys (null here: fake ranks hold no GPU)."""
    out = tmp_path / "rec"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "hang_daemon_e2e.py")]
        + ["--scenario", "remote-rank-missing", "--record", str(out), "--dry-run"]
        + ["--hang-seconds", "3", "--budget", "120"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    result = json.loads(done.stdout)
    assert result == json.loads((out / "result.json").read_text())
    assert done.returncode == 1 and result["ok"] is False  # nothing to flag without a GPU
    assert result["harness_exit"] == 0 and result["daemon_exit"] == 0
    assert {"seconds_to_verdict", "seconds_to_alert", "signature", "reason"} <= set(result)
    trace = json.loads((out / "run" / "remote_rank_missing" / "trace.json").read_text())
    assert list(trace["ranks"]) == ["0"] and trace["hang_start"] is not None
    env = trace["environ"]["0"]
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["RANK"]) == ("2", "1", "0")
    fixture = Path(result["fixture"])
    assert fixture == out / "fixture" / "remote-rank-missing-1xgpu"
    expect = json.loads((fixture / "expect.json").read_text())
    assert expect["conditions_any"] == ["rank_missing"] and expect["within_s"] == 30
    assert expect["hangs_config"]["stacks"] is True
    assert (out / "daemon.log").stat().st_size > 0


def test_the_cause_kills_script_faults_each_victim_beside_a_daemon_and_reports_per_scenario(
    tmp_path: Path,
) -> None:
    """cause_kills.py --dry-run: the daemon (replayed NVML) starts, each scenario's fake
    job steps, its rank 1 faults (a real SIGSEGV, host memory touched, an exit as after a
    CUDA error) and the harness reports per scenario; nothing is flagged without a GPU."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "cause_kills.py"), "--dry-run"]
        + ["--out-dir", str(out), "--warm", "0.2", "--deadline", "1", "--resolve-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    result = json.loads(done.stdout)
    assert result == json.loads((out / "result.json").read_text())
    assert done.returncode == 1 and result["ok"] is False, done.stderr
    assert result["daemon_exit"] == 0 and list(result["scenarios"]) == ["oom", "segfault", "xid31"]
    keys = {"seconds_to_verdict", "seconds_to_cause", "seconds_to_alert", "seconds_to_resolved"}
    for name, row in result["scenarios"].items():
        assert keys | {
            "cause",
            "cause_kind",
            "alert_cause",
            "named_right",
            "names_victim",
            "in_time",
        } <= set(row)
        assert row["error"] == "no /hangs record within 1.0 s of the fault", row
        assert row["fault_at"] and not row["named_right"] and row["hangs_before_fault"] == []
        assert "fault " in (out / f"{name}-rank1.log").read_text()
        assert (out / f"{name}-daemon.log").exists()
    victims = {name: row["victim_exit"] for name, row in result["scenarios"].items()}
    assert victims == {"oom": -9, "segfault": -11, "xid31": 1}  # oom: no cgroup, killed at the end
    assert (out / "fixture" / "cause-kills-1xh200" / "live.json").exists()
    for name in result["scenarios"]:  # the kernel's records of each fault are kept
        assert (out / "fixture" / "cause-kills-1xh200" / f"{name}.kmsg").exists()


def test_the_job_cpu_script_measures_the_daemon_idle_training_and_hung(tmp_path: Path) -> None:
    """job_cpu.py --dry-run: the daemon (replayed NVML) is measured in three phases beside
    fake ranks, the last one stopped; nothing is flagged without a GPU."""
    out = tmp_path / "job-cpu.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "job_cpu.py"), "--dry-run", "--ranks", "2"]
        + ["--seconds", "1", "--settle", "0.5", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    result = json.loads(done.stdout)
    assert result == json.loads(out.read_text())
    assert done.returncode == 1 and result["ok"] is False, done.stderr  # no GPU: no hang
    assert result["daemon_exit"] == 0 and result["stopped_pid"] > 0
    for name in ("idle", "training", "hung"):
        row = result[name]
        assert row["seconds"] >= 1 and row["scrapes"] >= 1 and row["rss_mib"] > 0
        assert 0 <= row["cpu_percent_of_one_core"] < 100 and row["hangs"] == []


TWO_NODES = ROOT / "tests" / "gpu" / "two_nodes.sh"


def no_alertmanager() -> bool:
    import shutil

    return not shutil.which("prometheus-alertmanager") and not shutil.which("alertmanager")


def two_nodes_dry_run(out: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.Popen(
        ["bash", str(TWO_NODES), str(out), "--dry-run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def started_pids(out: Path) -> dict[str, int]:
    rows = [line.split() for line in (out / "pids.txt").read_text().splitlines()]
    return {name: int(pid) for pid, _, name in rows}


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False


def test_the_two_node_script_dry_run_kills_a_rank_of_node_b_reports_and_cleans_up(
    tmp_path: Path,
) -> None:
    """two_nodes.sh --dry-run: Alertmanager, two daemons (replayed NVML) and two fake
    ranks start, node B's rank is killed, daemon A and Alertmanager are polled, the
    figures land in result.json and every process started has ended; nothing can be
    named without a GPU, so the run fails."""
    if no_alertmanager():
        pytest.skip("alertmanager not installed (Debian package prometheus-alertmanager)")
    out = tmp_path / "out"
    proc = two_nodes_dry_run(out)
    stdout, stderr = proc.communicate(timeout=60)
    result = json.loads(stdout)
    assert result == json.loads((out / "result.json").read_text())
    assert proc.returncode == 1 and result["ok"] is False and result["error"] is None, stderr
    assert {
        "seconds_to_verdict",
        "seconds_to_named",
        "seconds_to_group",
        "reason",
        "names_victim_rank",
        "names_node_b",
        "remote_named_in_time",
        "groups",
        "grouped",
        "daemon_a_sees_b_ranks",
        "nodes",
        "victim",
    } <= set(result)
    assert result["victim"] == {
        "rank": 1,
        "pid": result["ranks"]["1"],
        "node": "node-b",
        "exit": -9,
    }
    assert result["nodes"]["a"]["port"] != result["nodes"]["b"]["port"]
    assert result["exits"]["daemon-a"] == 0 and result["exits"]["daemon-b"] == 0
    assert result["groups"] == []
    for name in ("alertmanager", "daemon-a", "daemon-b", "rank0", "rank1"):
        assert (out / f"{name}.log").exists(), name
    assert not any(alive(pid) for pid in started_pids(out).values())
    assert "processes left over: 0" in (out / "cleanup.log").read_text()


def test_the_two_node_script_ends_what_its_harness_left_when_the_harness_dies(
    tmp_path: Path,
) -> None:
    """The harness killed mid-run leaves Alertmanager, the daemons and the ranks behind:
    the driver's trap ends each of them (by pid and start time), and nothing else."""
    if no_alertmanager():
        pytest.skip("alertmanager not installed (Debian package prometheus-alertmanager)")
    import signal
    import time

    out = tmp_path / "out"
    proc = two_nodes_dry_run(out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (out / "pids.txt").exists() and "rank1" in started_pids(out):
            break
        time.sleep(0.1)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, children  # the harness
    os.kill(int(children[0]), signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == 137
    started = started_pids(out)
    assert not any(alive(pid) for pid in started.values())
    log = (out / "cleanup.log").read_text()
    for name, pid in started.items():
        assert f"killed {name} (pid {pid})" in log, log
    assert f"processes left over: {len(started)}" in log


@pytest.mark.parametrize(("job_b", "grouped"), [("torch:10.77.0.1:29500", True), ("other", False)])
def test_the_two_node_check_groups_one_job_across_nodes_in_a_real_alertmanager(
    tmp_path: Path, job_b: str, grouped: bool
) -> None:
    """The script's Alertmanager route (JobHangSuspected grouped by alertname and job_id)
    and its check: one alert per node; one incident only when both carry the same job."""
    import time
    import urllib.request

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from two_nodes import AM_CONFIG, am_groups, one_incident

    from tests.servers import AlertmanagerServer

    server = AlertmanagerServer(tmp_path / "am")
    server.config.write_text(AM_CONFIG)
    server.start()
    try:
        alerts = [
            {"labels": {"alertname": "JobHangSuspected", "node": node, "job_id": job}}
            for node, job in (("node-a", "torch:10.77.0.1:29500"), ("node-b", job_b))
        ]
        req = urllib.request.Request(
            f"{server.url}/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5).close()
        deadline = time.monotonic() + 10
        groups = am_groups(server.url)
        while sum(len(g["alerts"]) for g in groups) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            groups = am_groups(server.url)
        assert sum(len(g["alerts"]) for g in groups) == 2, groups
        assert len(groups) == (1 if grouped else 2)
        assert one_incident(groups, {"node-a", "node-b"}) is grouped
    finally:
        server.stop()


def test_the_two_node_check_reads_the_ranks_a_reason_names() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from two_nodes import ranks_named

    assert ranks_named("rank 3 died (pid 12) and the others have made no progress") == {3}
    assert ranks_named("ranks 2-4, 7 never arrived (expected on other nodes)") == {2, 3, 4, 7}
    assert ranks_named("Job torch:10.77.0.1:29500 hangs: no rank used its GPU") == set()


def test_the_two_node_script_refuses_one_gpu_in_one_line_and_makes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(TWO_NODES), str(out)],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PATH=fake_nvidia_smi(tmp_path, 1)),
        cwd=ROOT,
    )
    import shutil

    assert done.returncode == 2, done.stderr
    why = "needs at least 2 GPUs (nvidia-smi -L lists 1)"
    if os.geteuid() != 0:
        why = "needs root (network namespaces, a bridge)"
    elif not shutil.which("ip"):
        why = "needs ip (iproute2)"
    assert done.stderr == f"two_nodes.sh: {why}\n"
    assert not out.exists()
