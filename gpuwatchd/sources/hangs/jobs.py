"""A job's ranks on this node, as the hang detector sees them.

The detector takes `JobView`s, not the workload model directly, so it can
be fed from recorded data in tests and from any adapter. `jobs_from_gpu_processes`
builds them from the NVML source's processes and each process's
/proc/PID/environ (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
NCCL_RAS_ADDR, the launcher's job id) and /proc/PID/stat (CPU time).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from gpuwatchd.jobview import DEFAULT_RAS_ADDR, JobView, RankView, gpu_order
from gpuwatchd.model import Workload
from gpuwatchd.sources.workloads.environ import torch_job_id

__all__ = [
    "DEFAULT_RAS_ADDR",
    "JobView",
    "RankView",
    "job_id",
    "job_key",
    "jobs_from_gpu_processes",
    "jobs_from_workloads",
    "read_cpu_seconds",
    "read_environ",
]

_ENV_KEYS = (
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NCCL_RAS_ADDR",
    "NCCL_RAS_ENABLE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NNODES",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
_ENV_KEYS_RAW = frozenset(k.encode() for k in _ENV_KEYS)
_LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


def read_environ(pid: int, procfs: str = "/proc") -> dict[str, str]:
    """The hang-relevant variables of a process; {} when unreadable (gone, other user)."""
    try:
        with open(f"{procfs}/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in _ENV_KEYS_RAW:  # compared undecoded: a rank has hundreds
            env[key.decode()] = value.decode(errors="replace")
    return env


def read_cpu_seconds(pid: int, procfs: str = "/proc") -> float | None:
    """utime+stime of a process, every thread's (live or exited), in seconds; None when
    it is gone. One read of /proc/PID/stat, which holds the thread group's total: summing
    /proc/PID/task/*/stat cost 7 ms for eight 80-thread ranks at every NVML poll. A tree
    without the process's stat (a recorded fixture) is summed over its tasks."""
    try:
        with open(f"{procfs}/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except FileNotFoundError:
        return _tasks_cpu_seconds(pid, procfs)
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (IndexError, ValueError):
        return None


def _tasks_cpu_seconds(pid: int, procfs: str) -> float | None:
    try:
        tasks = os.listdir(f"{procfs}/{pid}/task")
    except OSError:
        return None
    ticks = 0
    for tid in tasks:
        try:
            with open(f"{procfs}/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # a thread that exited between listdir and open
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 12:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / _CLK_TCK


def _command(pid: int, procfs: str) -> str:
    try:
        with open(f"{procfs}/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read(4096).split(b"\0") if a]
    except OSError:
        return ""
    return " ".join([os.path.basename(argv[0]), *argv[1:]])[:160] if argv else ""


def job_key(pid: int, env: Mapping[str, str]) -> str:
    """Which job a process belongs to, from its launcher's variables."""
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID", "")
        return f"slurm:{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    torch = torch_job_id(
        env.get("TORCHELASTIC_RUN_ID", ""), env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    )
    return torch or f"pid:{pid}"


def job_id(key: str, envs: Iterable[Mapping[str, str]], slurm_job: str = "") -> str:
    """The job's name on every node: Slurm job id, else the launcher's run id or
    MASTER_ADDR:PORT (shared by the pods of one training job), else this node's key."""
    envs = list(envs)
    slurm = slurm_job or next((e["SLURM_JOB_ID"] for e in envs if e.get("SLURM_JOB_ID")), "")
    if slurm:
        return f"slurm:{slurm}"
    for env in envs:
        torch = torch_job_id(
            env.get("TORCHELASTIC_RUN_ID", ""),
            env.get("MASTER_ADDR", ""),
            env.get("MASTER_PORT", ""),
        )
        if torch:
            return torch
    return key


def _expected_local(envs: Iterable[Mapping[str, str]]) -> tuple[int | None, int | None]:
    """(local ranks expected, world size) from the first process that says."""
    for env in envs:
        world = _int(env.get("WORLD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE"))
        local = _int(env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE"))
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        if local is None and _int(per_node) is not None:
            local = _int(per_node)
        single_node = env.get("SLURM_NNODES") == "1" or (
            "SLURM_NNODES" not in env and env.get("MASTER_ADDR", "") in _LOCAL_HOSTS
        )
        if local is None and world is not None and single_node:
            local = world
        if local is not None or world is not None:
            return local, world
    return None, None


def _parent(pid: int, procfs: str) -> int | None:
    try:
        with open(f"{procfs}/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        return int(text[text.rfind(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _starting_ranks(
    key: str, pids: list[int], procfs: str
) -> list[tuple[RankView, Mapping[str, str]]]:
    """Ranks of the job, started by the same launcher, that hold no CUDA context yet.

    A rank still importing its framework is not listed by NVML; without this the
    ranks already waiting at the rendezvous would count it as never started.
    """
    out: list[tuple[RankView, Mapping[str, str]]] = []
    seen = set(pids)
    for parent in {p for p in (_parent(pid, procfs) for pid in pids) if p and p > 1}:
        try:
            with open(f"{procfs}/{parent}/task/{parent}/children", "rb") as f:
                children = [int(c) for c in f.read().split()[:256]]
        except (OSError, ValueError):
            continue
        for child in children:
            if child in seen:
                continue
            seen.add(child)
            env = read_environ(child, procfs)
            if not env or job_key(child, env) != key:
                continue
            view = RankView(
                pid=child,
                gpus=(),
                rank=_int(env.get("RANK") or env.get("SLURM_PROCID")),
                local_rank=_int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID")),
                world_size=_int(env.get("WORLD_SIZE")),
                cpu_seconds=read_cpu_seconds(child, procfs),
                ras_addr=env.get("NCCL_RAS_ADDR") or DEFAULT_RAS_ADDR,
                command=_command(child, procfs),
            )
            out.append((view, env))
    return out


def jobs_from_gpu_processes(
    gpu_pids: Mapping[str, Iterable[int]],
    procfs: str = "/proc",
    environ: Mapping[int, Mapping[str, str]] | None = None,
) -> list[JobView]:
    """Group the GPU processes NVML reports into jobs by their launcher's variables.

    `gpu_pids` maps GPU index -> pids holding a context there. `environ`
    replaces /proc/PID/environ (tests, or another adapter that already has it).
    """
    gpus_of: dict[int, list[str]] = {}
    for gpu, pids in gpu_pids.items():
        for pid in pids:
            gpus_of.setdefault(int(pid), []).append(str(gpu))
    by_job: dict[str, list[tuple[RankView, Mapping[str, str]]]] = {}
    for pid, gpus in sorted(gpus_of.items()):
        env = environ.get(pid, {}) if environ is not None else read_environ(pid, procfs)
        rank = _int(env.get("RANK") or env.get("SLURM_PROCID") or env.get("OMPI_COMM_WORLD_RANK"))
        view = RankView(
            pid=pid,
            gpus=tuple(sorted(set(gpus), key=gpu_order)),
            rank=rank,
            local_rank=_int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID")),
            world_size=_int(env.get("WORLD_SIZE")),
            cpu_seconds=read_cpu_seconds(pid, procfs),
            ras_addr=env.get("NCCL_RAS_ADDR") or DEFAULT_RAS_ADDR,
            command=_command(pid, procfs),
        )
        by_job.setdefault(job_key(pid, env), []).append((view, env))
    jobs = []
    for key, members in sorted(by_job.items()):
        local, world = _expected_local(env for _, env in members)
        if local is not None and len(members) < local and environ is None:
            members += _starting_ranks(key, [v.pid for v, _ in members], procfs)
        labels = [("job", key), ("job_id", job_id(key, (e for _, e in members)))]
        slurm = next((e["SLURM_JOB_ID"] for _, e in members if e.get("SLURM_JOB_ID")), "")
        if slurm:
            labels.append(("slurm_job", slurm))
        jobs.append(
            JobView(
                job=key,
                ranks=tuple(v for v, _ in members),
                expected_local=local,
                world_size=world,
                labels=tuple(labels),
                ras_addr=members[0][0].ras_addr,
            )
        )
    return jobs


def jobs_from_workloads(workloads: Iterable[Workload], procfs: str = "/proc") -> list[JobView]:
    """Jobs from the workloads source (pods, Slurm jobs, torch jobs, bare processes).

    A pod or Slurm job is one job. Torch jobs and bare processes are grouped
    by their launcher's variables, as `jobs_from_gpu_processes` does (the
    environ this needs holds more than the workloads source keeps); the job
    key is the workload id, both come from `torch_job_id`.
    """
    out: list[JobView] = []
    bare: dict[str, list[int]] = {}
    for w in workloads:
        if w.kind in ("process", "torch"):  # regrouped below, named by the same torch_job_id
            for p in w.processes:
                bare.setdefault(p.gpu, []).append(p.pid)
            continue
        gpus_of: dict[int, list[str]] = {}
        for p in w.processes:
            gpus_of.setdefault(p.pid, []).append(p.gpu)
        envs = {pid: read_environ(pid, procfs) for pid in gpus_of}
        ranks = []
        for pid, gpus in sorted(gpus_of.items()):
            env = envs[pid]
            proc = w.process(pid)
            rank = _int(proc.rank if proc and proc.rank else env.get("RANK"))
            ranks.append(
                RankView(
                    pid=pid,
                    gpus=tuple(sorted(set(gpus), key=gpu_order)),
                    rank=rank,
                    local_rank=_int(proc.local_rank if proc else env.get("LOCAL_RANK")),
                    world_size=_int(w.world_size or env.get("WORLD_SIZE")),
                    cpu_seconds=read_cpu_seconds(pid, procfs),
                    ras_addr=env.get("NCCL_RAS_ADDR") or DEFAULT_RAS_ADDR,
                    command=_command(pid, procfs),
                )
            )
        local, world = _expected_local(envs.values())
        key = f"{w.kind}:{w.id}"
        labels = [("job", key), ("job_id", job_id(key, envs.values(), w.slurm_job))]
        labels += [(k, v) for k, v in (("namespace", w.namespace), ("pod", w.pod)) if v]
        if w.slurm_job:
            labels.append(("slurm_job", w.slurm_job))
        out.append(
            JobView(
                job=key,
                ranks=tuple(ranks),
                expected_local=local,
                world_size=world or _int(w.world_size),
                labels=tuple(labels),
                ras_addr=ranks[0].ras_addr if ranks else DEFAULT_RAS_ADDR,
            )
        )
    out += jobs_from_gpu_processes(bare, procfs)
    return sorted(out, key=lambda j: j.job)
