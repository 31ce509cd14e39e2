"""A real one-node Slurm cluster on 127.0.0.1 for tests: munged, slurmctld and slurmd.

Debian's `slurm-wlm` and `munge` (installed by `scripts/setup --dev`) run as
root from a temporary directory: a fresh munge key and socket, a generated
`slurm.conf` with free loopback ports, state and spool directories, no
cgroups (proctrack/linuxproc, task/none). Nothing under /etc is used or
changed. Client commands (`scontrol`, `sbatch`, `squeue`, `srun`) reach this
cluster through `cluster.env` (SLURM_CONF points at the generated file), or
through `cluster.run([...])`.

Use it from a conftest or a test module:

    from tests.slurm_cluster import SlurmCluster, slurm_cluster

    @pytest.fixture(scope="session")
    def slurm(tmp_path_factory):
        yield from slurm_cluster(tmp_path_factory)

    def test_job(slurm: SlurmCluster):
        job = slurm.submit("sleep 60", name="train")   # sbatch --parsable, returns the id
        slurm.wait_state(job, "RUNNING")
        out = slurm.run(["squeue", "--json", "--jobs", job])   # Debian 12 ships 22.05
        slurm.run(["scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN", "Reason=x"])

The fixture skips (never fails) with the reason when the binaries are missing,
the tests do not run as root, or the daemons do not come up in time; the
reason includes the tail of the daemon logs. Each xdist worker gets its own
cluster (own ports and directories). The node is named after the host
(`cluster.node`), because slurmd must find its own NodeName.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["SlurmCluster", "slurm_cluster"]

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch")

SLURM_CONF = """\
ClusterName=gpuwatchd-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd.pid
SlurmctldLogFile={run}/slurmctld.log
SlurmdLogFile={run}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=2
Waittime=0
PlugStackConfig={run}/plugstack.conf
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class SlurmCluster:
    """munged + slurmctld + slurmd of one node, all on loopback, files under `workdir`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.run_dir = workdir / "run"
        self.node = socket.gethostname().split(".")[0]
        self.conf = workdir / "slurm.conf"
        self.munge_socket = self.run_dir / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, timeout: float = 30.0) -> None:
        """Write key and config, start the three daemons, wait until the node is idle."""
        for sub in ("run", "state", "spool", "munge"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses directories others may write to.
        for d in (self.workdir, self.run_dir, self.workdir / "munge"):
            d.chmod(0o700)
        key = self.workdir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.run_dir / "plugstack.conf").write_text("")
        self.conf.write_text(
            SLURM_CONF.format(
                node=self.node,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                munge_socket=self.munge_socket,
                state=self.workdir / "state",
                spool=self.workdir / "spool",
                run=self.run_dir,
                cpus=max(2, os.cpu_count() or 2),
            )
        )
        munged = [
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.run_dir / 'munged.pid'}",
            f"--log-file={self.run_dir / 'munged.log'}",
            f"--seed-file={self.workdir / 'munge' / 'munged.seed'}",
        ]
        self._spawn(munged, "munged.out")
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._wait(self._ctld_up, timeout, "slurmctld ping")
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], "slurmd.out")
        self._wait(self._node_ready, timeout, "node idle")

    def _spawn(self, args: list[str], out: str) -> None:
        with open(self.run_dir / out, "ab") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir
            )
        self.procs.append(proc)

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        assert callable(ready)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for proc in self.procs:
                if proc.poll() is not None:
                    name = str(proc.args[0]) if isinstance(proc.args, list) else "daemon"
                    raise RuntimeError(f"{name} exited ({proc.returncode}): {self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def _ctld_up(self) -> bool:
        res = self.run(["scontrol", "ping"], check=False, timeout=5)
        return "UP" in res.stdout

    def _node_ready(self) -> bool:
        res = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout=5)
        return res.stdout.strip() in ("idle", "mix", "alloc")

    def logs(self) -> str:
        """Tails of the daemon logs, for failure messages."""
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            text = _tail(self.run_dir / name, 600)
            if text:
                parts.append(f"--- {name}\n{text}")
        return "\n".join(parts)

    def run(
        self, args: list[str], check: bool = True, timeout: float = 20.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def submit(self, command: str, name: str = "test", extra: tuple[str, ...] = ()) -> str:
        """sbatch a shell command on this node; returns the job id."""
        res = self.run(
            [
                "sbatch",
                "--parsable",
                f"--job-name={name}",
                f"--output={self.workdir / 'job-%j.out'}",
                f"--chdir={self.workdir}",
                *extra,
                f"--wrap={command}",
            ]
        )
        return res.stdout.strip().split(";")[0]

    def wait_state(self, job: str, state: str, timeout: float = 30.0) -> None:
        """Wait until `squeue` shows the job in `state` (e.g. RUNNING)."""
        end = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < end:
            seen = self.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
            if seen == state:
                return
            time.sleep(0.2)
        raise AssertionError(f"job {job} is {seen!r}, not {state}: {self.logs()}")

    def stop(self) -> None:
        """Cancel its jobs, stop its daemons (slurmd, slurmctld, munged) and job steps."""
        if self.procs and all(p.poll() is None for p in self.procs):
            # A step whose slurmd is gone waits for it forever: end the jobs first.
            self.run(["scancel", "--full", f"--nodelist={self.node}"], check=False, timeout=10)
            end = time.monotonic() + 10
            while time.monotonic() < end:
                res = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=5)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.2)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self.procs.clear()
        self._kill_steps()

    def _kill_steps(self) -> None:
        """slurmstepd processes of this cluster that outlived it (found by their SLURM_CONF)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "comm").read_text().strip() != "slurmstepd":
                    continue
                if mine not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Generator for a session fixture: a started cluster, or a skip saying why not."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)}): run scripts/setup --dev")
    if os.geteuid() != 0:
        pytest.skip("the loopback Slurm cluster runs slurmd as root; tests are not root")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        cluster.stop()
        pytest.skip(f"Slurm on loopback did not start: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
