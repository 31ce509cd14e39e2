"""pid -> Kubernetes pod / Slurm job / container / unit, from /proc/PID/cgroup."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatchd.sources.workloads.cgroup import attribute, parse_cgroup, start_ticks

CID = "3f1c" * 16


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # cgroup v2, systemd driver (kubelet on a modern distribution)
        (
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
            f"0c1d2e3f_4a5b_6c7d_8e9f_a0b1c2d3e4f5.slice/cri-containerd-{CID}.scope\n",
            dict(
                status="kubernetes",
                pod_uid="0c1d2e3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5",
                container_id=CID,
            ),
        ),
        # cgroup v1, cgroupfs driver: many controllers, the pids one places it
        (
            "12:pids:/kubepods/burstable/pod0c1d2e3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5/" + CID + "\n"
            "11:memory:/kubepods/burstable/pod0c1d2e3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5/" + CID + "\n"
            "1:name=systemd:/kubepods/burstable/pod0c1d2e3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5/" + CID,
            dict(
                status="kubernetes",
                pod_uid="0c1d2e3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5",
                container_id=CID,
            ),
        ),
        # Slurm, cgroup v1
        (
            "9:memory:/slurm/uid_1000/job_123/step_0/task_1\n"
            "4:pids:/slurm/uid_1000/job_123/step_0/task_1\n",
            dict(status="slurm", slurm_job="123", slurm_step="0", slurm_uid="1000"),
        ),
        # Slurm, cgroup v2 (slurmstepd scope)
        (
            "0::/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0\n",
            dict(status="slurm", slurm_job="4242", slurm_step="batch"),
        ),
        ("0::/system.slice/docker-" + CID + ".scope\n", dict(status="container", container_id=CID)),
        (
            "0::/system.slice/nvidia-persistenced.service\n",
            dict(status="systemd", unit="nvidia-persistenced.service"),
        ),
        (
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            dict(status="systemd", unit="session-3.scope"),
        ),
        ("0::/\n", dict(status="host")),
        ("", dict(status="host")),
    ],
)
def test_parse_cgroup(text: str, want: dict) -> None:
    got = parse_cgroup(text)
    assert {k: getattr(got, k) for k in want} == want


def proc(tmp_path: Path, pid: int, cgroup: str, comm: str = "python3") -> Path:
    d = tmp_path / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "comm").write_text(comm + "\n")
    return tmp_path


def test_attribute_a_live_pid(tmp_path: Path) -> None:
    root = proc(tmp_path, 4242, "0::/slurm/uid_7/job_99/step_0/task_0\n")
    a = attribute(str(root), 4242, "python3")
    assert (a.status, a.slurm_job) == ("slurm", "99")
    assert ("attribution", "slurm") in a.attrs() and ("slurm_job", "99") in a.attrs()


def test_process_gone(tmp_path: Path) -> None:
    assert attribute(str(tmp_path), 4242, "python3").status == "process gone"


def test_pid_reused_by_another_program(tmp_path: Path) -> None:
    root = proc(tmp_path, 4242, "0::/\n", comm="sshd")
    assert attribute(str(root), 4242, "python3").status == "pid reused"


def test_long_names_compare_on_the_kernels_15_characters(tmp_path: Path) -> None:
    root = proc(tmp_path, 7, "0::/\n", comm="pt_main_thread")
    assert attribute(str(root), 7, "pt_main_thread").status == "host"
    root2 = proc(tmp_path / "b", 8, "0::/\n", comm="UnrealEditor-Li")
    assert attribute(str(root2), 8, "UnrealEditor-Linux").status == "host"


def test_our_own_process_on_the_real_proc() -> None:
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    a = attribute("/proc", os.getpid(), comm)
    assert a.status in {"kubernetes", "slurm", "container", "systemd", "host"}
    assert a.cgroup.startswith("/")


def test_start_ticks_reads_field_22_past_a_comm_with_parentheses(tmp_path: Path) -> None:
    d = tmp_path / "77"
    d.mkdir()
    (d / "stat").write_text("77 (a) b (c) S 1 77 77 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 123456 0 0\n")
    assert start_ticks(str(tmp_path), 77) == 123456
    assert start_ticks(str(tmp_path), 78) is None
    assert start_ticks("/proc", os.getpid()) is not None
