"""The node I/O behind the hang monitor: job views from /proc, py-spy stacks, NCCL RAS.

The monitor (health/hangs) decides on values; this daemon-layer adapter hands it
the sources' readers, so the health layer never imports a source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gpuwatchd.jobview import JobView, RasAnswer, StackCapture
from gpuwatchd.sources.hangs import ras
from gpuwatchd.sources.hangs.jobs import jobs_from_gpu_processes, jobs_from_workloads, read_environ
from gpuwatchd.sources.hangs.proc import probe_jobs
from gpuwatchd.state import NodeSnapshot

if TYPE_CHECKING:
    from gpuwatchd.sources.hangs import flight

__all__ = ["NodeForensics"]


class NodeForensics:
    """`health.hangs.ports.NodeIO` over the real node."""

    def jobs(self, snap: NodeSnapshot, procfs: str) -> list[JobView]:
        """Jobs from the workloads source when it runs, else from NVML's processes."""
        wl = snap.sources.get("workloads")
        if wl is not None and wl.ok and wl.workloads is not None:
            return jobs_from_workloads(list(wl.workloads.current), procfs)
        nvml = snap.sources.get("nvml")
        if nvml is None or nvml.inventory is None:
            return []
        return jobs_from_gpu_processes(nvml.inventory.pids_by_gpu(), procfs)

    def capture(self, pid: int, timeout: float) -> StackCapture:
        """One py-spy dump of `pid`, bounded by `timeout`."""
        from gpuwatchd.sources.hangs import stacks  # only on suspicion: kept out of the RSS

        return stacks.capture(pid, timeout=timeout)

    def ras(self, job: JobView, netns: bool, timeout: float) -> RasAnswer:
        """Ask the job's NCCL RAS service, from its network namespace when `netns`."""
        if netns and job.ranks:
            return ras.query_in_netns(job.ranks[0].pid, job.ras_addr, timeout=timeout)
        return ras.query(job.ras_addr, timeout=timeout)

    def probe(self, jobs: Sequence[JobView], procfs: str) -> list[JobView]:
        """Each rank's liveness, CPU time and I/O bytes (and its children's), read now."""
        return probe_jobs(jobs, procfs)

    def flight(
        self, job: JobView, procfs: str, wait: Callable[[float], object]
    ) -> tuple[list[flight.GroupProgress], list[str]]:
        """Trigger each rank's flight recorder dump (where the job set a pipe), read them."""
        from gpuwatchd.sources.hangs import flight  # only on suspicion (pickle and all)

        envs = {r.pid: read_environ(r.pid, procfs) for r in job.ranks if r.alive}
        now = time.time()
        ranked = [
            (r.pid, r.rank, now - (r.age_seconds or 0.0))
            for r in job.ranks
            if r.alive and r.rank is not None
        ]
        pipes = [flight.pipe_path(pid, rank, envs[pid], procfs) for pid, rank, _ in ranked]
        # Every rank's pipe, not the first that answers: the culprit is the rank whose
        # dump says where it stands (any() stopped at rank 0 on 4x H200).
        triggered = [flight.trigger(p) for p in pipes if p is not None]
        paths = [
            (rank, flight.dump_path(pid, rank, envs[pid], procfs), started)
            for pid, rank, started in ranked
        ]
        dumps: dict[int, dict[str, object]] = {}
        problems: list[str] = []
        for pause in (2.0, 3.0) if any(triggered) else (0.0,):
            if pause:
                wait(pause)  # the ranks write their dumps from their own threads
            dumps, problems = flight.read_dumps(paths)
            if len(dumps) >= sum(triggered):
                break
        return flight.progress(dumps), problems
