"""Slurm job facts (name, user, state) for a job id the cgroup gave, from Slurm itself.

`scontrol show job --json ID` (Slurm 23.02+), falling back to
`squeue --json --jobs ID` (21.08+, e.g. Debian 12's 22.05) when scontrol
has no --json. Every call is bounded by a timeout; answers are cached per
job (a job's name and user do not change), failures for a short while so
a broken slurmctld is not asked on every poll. Without Slurm client
commands the lookup answers None and the workload keeps the id alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["SlurmJob", "SlurmJobs", "parse_jobs"]


class SlurmJob(NamedTuple):
    """What Slurm says about one job."""

    job_id: str
    name: str = ""
    user: str = ""
    state: str = ""
    partition: str = ""
    account: str = ""


def _state(value: object) -> str:
    if isinstance(value, list):  # newer Slurm: a list of flags, the base state first
        return ",".join(str(v) for v in value)
    return str(value or "")


def parse_jobs(text: str, job_id: str) -> SlurmJob | None:
    """The job `job_id` in a scontrol/squeue --json document, or None."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    for job in jobs if isinstance(jobs, list) else []:
        if isinstance(job, dict) and str(job.get("job_id")) == job_id:
            return SlurmJob(
                job_id,
                name=str(job.get("name") or ""),
                user=str(job.get("user_name") or ""),
                state=_state(job.get("job_state")),
                partition=str(job.get("partition") or ""),
                account=str(job.get("account") or ""),
            )
    return None


class SlurmJobs:
    """Cached, time-bounded job lookups through the Slurm client commands."""

    def __init__(
        self,
        timeout: float = 2.0,
        retry_after: float = 60.0,
        max_cached: int = 1024,
        env: dict[str, str] | None = None,
        which: Callable[[str], str | None] = shutil.which,
    ) -> None:
        self.timeout = timeout
        self.retry_after = retry_after
        self.max_cached = max_cached
        self.env = env
        self._which = which
        self._cache: dict[str, SlurmJob] = {}
        self._failed: dict[str, float] = {}
        self._scontrol_json = True
        self.errors: dict[str, int] = {}
        self.calls = 0

    def available(self) -> bool:
        """Whether the Slurm client commands are installed."""
        return self._which("scontrol") is not None or self._which("squeue") is not None

    def cached(self, job_id: str) -> SlurmJob | None:
        """The cached facts of `job_id`, asking nobody."""
        return self._cache.get(job_id)

    def would_ask(self, job_id: str, now: float) -> bool:
        """Whether lookup() would run a command (not cached, not failed recently)."""
        recent = now - self._failed.get(job_id, float("-inf")) < self.retry_after
        return job_id.isdigit() and job_id not in self._cache and not recent

    def lookup(self, job_id: str, now: float) -> SlurmJob | None:
        """Facts about `job_id`, from the cache or from Slurm (bounded by `timeout`)."""
        if not job_id.isdigit():
            return None
        hit = self._cache.get(job_id)
        if hit is not None:
            return hit
        if now - self._failed.get(job_id, float("-inf")) < self.retry_after:
            return None
        job = self._ask(job_id)
        if job is None:
            self._failed[job_id] = now
            if len(self._failed) > self.max_cached:
                self._failed.pop(next(iter(self._failed)))
            return None
        self._failed.pop(job_id, None)
        if len(self._cache) >= self.max_cached:
            self._cache.pop(next(iter(self._cache)))
        self._cache[job_id] = job
        return job

    def _ask(self, job_id: str) -> SlurmJob | None:
        if self._scontrol_json and self._which("scontrol") is not None:
            out, err = self._run(["scontrol", "show", "job", "--json", job_id], probe=True)
            if out is not None:
                return parse_jobs(out, job_id)
            if "unrecognized option" in err or "invalid option" in err:
                self._scontrol_json = False  # before 23.02: ask squeue from now on
            else:
                if err:  # a timeout or exec failure is counted already
                    self._count("exit")
                return None
        if self._which("squeue") is None:
            self._count("absent")
            return None
        out, _ = self._run(["squeue", "--json", "--jobs", job_id])
        return parse_jobs(out, job_id) if out is not None else None

    def _run(self, args: list[str], probe: bool = False) -> tuple[str | None, str]:
        """stdout, or None and stderr's tail; `probe` leaves a non-zero exit to the caller."""
        self.calls += 1
        try:
            res = subprocess.run(
                args,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                env=self.env,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            self._count("timeout")
            return None, ""
        except OSError:
            self._count("exec")
            return None, ""
        if res.returncode != 0:
            if not probe:
                self._count("exit")
            return None, res.stderr[-500:]
        return res.stdout, ""

    def _count(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
