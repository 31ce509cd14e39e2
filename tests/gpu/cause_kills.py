#!/usr/bin/env python3
"""On a real GPU: a rank dies of a real fault and the daemon's hang incident names it.

Starts `python -m gpuwatchd run` as a user would (default config; only the listen
address and the state directory are set), then runs each scenario with a fresh
2-rank job: torch.distributed on `gloo` (one GPU cannot hold two NCCL ranks), both
ranks with a CUDA context on cuda:0 (a small matmul per step, so NVML lists both as
the job's ranks on GPU 0) and an all_reduce of a CPU tensor every ~0.2 s. After
--warm seconds of steps rank 1 faults:

- oom: the harness moves rank 1 into a new cgroup v2 (memory.max --memory-max,
  memory.swap.max 0) and rank 1 allocates host memory until the OOM killer kills it
  (it is moved at the fault, not at start: memory charged before the move stays with
  the old cgroup, so the rank's start-up, torch and its CUDA context, cannot be killed);
- segfault: rank 1 reads address 0 with Python's faulthandler off (the kernel logs
  `segfault at 0`, when /proc/sys/debug/exception-trace is 1);
- xid31: rank 1 has one CUDA thread store to an unmapped address (Xid 31) and exits
  with the error, as an uncaught CUDA error does.

Rank 0 waits: gloo reports the lost peer as an error at once, where NCCL would block,
so rank 0 catches it and blocks. The harness polls /hangs every 0.5 s for a record of
the job (--deadline 60 s), then the cause and the JobHangSuspected alert in /alerts,
kills the job and waits for the hang to resolve. Run from the repository root, as root,
on a machine with an NVIDIA GPU and PyTorch:

    python3 tests/gpu/cause_kills.py [--scenario oom --scenario segfault ...] [--out-dir DIR]

Prints one JSON object (also DIR/result.json); DIR/<scenario>-daemon.log holds the
daemon's log during the scenario, DIR/<scenario>-rank{0,1}.log the ranks' output,
DIR/<scenario>-kmsg.raw the raw /dev/kmsg records from just before the fault until the
alert. With --out-dir the run is also a CI fixture: DIR/fixture/cause-kills-1xh200
holds those records and live.json (the pids, the fault's kernel timestamp, what the
daemon named), which tests/hangs/test_live_cause_recordings.py replays through the
kernel log source and the cause join.
Exit 0 when every scenario's cause names the right class within --within (30) s of the
fault, 1 otherwise, 2 when there is no GPU. --dry-run: fake ranks (no CUDA, no gloo, no
cgroup) beside the daemon on a replayed NVML capture: the plumbing only.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu: its sibling scripts
from hang_daemon_e2e import free_port, get, no_gpu  # noqa: E402
from hang_daemon_e2e import job_env as shared_job_env  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCENARIOS = ("oom", "segfault", "xid31")
KIND = {"oom": "oom_kill", "segfault": "segfault", "xid31": "xid"}
REPLAYED_CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-record.json"
CGROUP_ROOT = Path("/sys/fs/cgroup")
POLL = 0.5
KMSG = Path("/dev/kmsg")
FIXTURE = "cause-kills-1xh200"


# --- the kernel log, as the daemon reads it -----------------------------------------------


class KmsgTap:
    """Raw /dev/kmsg records from the moment it opens (positioned at the log's end)."""

    def __init__(self, path: Path = KMSG) -> None:
        self.records: list[str] = []
        self.error = ""
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as exc:
            self.error = f"{path}: {exc}"

    def drain(self) -> list[str]:
        while self._fd >= 0:
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them: go on
                continue
            except OSError as exc:
                self.error = str(exc)
                break
            if not chunk:
                break
            self.records.append(chunk.decode("utf-8", "replace").rstrip("\n"))
        return self.records

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def kernel_usec() -> int:
    """Now on the kernel log's clock (CLOCK_MONOTONIC in microseconds)."""
    return time.monotonic_ns() // 1000


def gpu_bus_id() -> str:
    """GPU 0's PCI bus id as NVML gives it (the Xid line names it), '' without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).busId
            return bus.decode() if isinstance(bus, bytes) else str(bus)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return ""


def write_fixture(out_dir: Path, result: dict[str, Any]) -> Path:
    """The run as a CI fixture: each scenario's raw kernel records and what was named."""
    fixture = out_dir / "fixture" / FIXTURE
    fixture.mkdir(parents=True, exist_ok=True)
    live: dict[str, Any] = {
        "date": result["date"],
        "gpu_bus_id": result.get("gpu_bus_id", ""),
        "exception_trace": result.get("exception_trace"),
        "scenarios": {},
    }
    keep = (
        "victim_pid",
        "peer_pid",
        "fault_at",
        "fault_usec",
        "seconds_to_verdict",
        "seconds_to_cause",
        "seconds_to_alert",
        "cause",
        "cause_kind",
        "cause_pid",
        "alert_cause",
        "named_right",
        "victim_exit",
        "job",
        "conditions",
        "reason",
        "causes",
    )
    for name, got in result["scenarios"].items():
        src = out_dir / f"{name}-kmsg.raw"
        if not src.exists() or "fault_usec" not in got:
            continue
        (fixture / f"{name}.kmsg").write_bytes(src.read_bytes())
        live["scenarios"][name] = {k: got.get(k) for k in keep}
    (fixture / "live.json").write_text(json.dumps(live, indent=1, default=str) + "\n")
    return fixture


# --- a rank -------------------------------------------------------------------------------


def touch_pages(limit: int) -> None:
    """Allocate host memory in 64 MiB chunks, every page written, up to `limit` bytes."""
    chunk, kept = 64 << 20, []
    while len(kept) * chunk < limit:
        block = bytearray(chunk)
        block[::4096] = b"\x01" * len(range(0, chunk, 4096))
        kept.append(block)
    print(f"allocated {len(kept) * chunk} bytes and was not killed", flush=True)
    time.sleep(600)


def fault(scenario: str, dry_run: bool) -> None:
    print(f"fault {scenario} at {time.time():.3f}", flush=True)
    if scenario == "oom":
        touch_pages(64 << 20 if dry_run else 8 << 30)
    elif scenario == "segfault":
        import ctypes

        signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # no handler of any library either
        ctypes.string_at(0)  # SIGSEGV with no handler: the kernel logs it
    elif dry_run:
        sys.exit(1)
    else:
        sys.path.insert(0, str(HERE))
        from faults import illegal_write_ptx

        r = illegal_write_ptx()
        print(f"xid31: {r}; CUDA error: an illegal memory access was encountered", flush=True)
        os._exit(1)  # as an uncaught CUDA error ends a rank, without gloo's teardown


def rank_main(scenario: str, run_dir: Path, dry_run: bool) -> int:
    faulthandler.disable()
    rank = int(os.environ["RANK"])
    step: Any = lambda: None  # noqa: E731
    if not dry_run:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        a, t = torch.randn(512, 512, device="cuda:0"), torch.ones(1)

        def step() -> None:
            (a @ a).sum().item()
            dist.all_reduce(t)

    n = 0
    while True:
        if rank == 1 and (run_dir / "fault").exists():
            fault(scenario, dry_run)
        try:
            step()
        except RuntimeError as exc:  # gloo: the peer is gone; NCCL would block here
            print(f"rank {rank} step {n}: {exc}; waiting", flush=True)
            while True:
                time.sleep(3600)
        n += 1
        if n == 1:
            (run_dir / f"ready-{rank}").touch()
        time.sleep(0.2)


# --- the harness --------------------------------------------------------------------------


def start_daemon(
    tmp: Path, port: int, dry_run: bool, extra: str = "", capture: Path = REPLAYED_CAPTURE
) -> subprocess.Popen[bytes]:
    """`gpuwatchd run` on its defaults (plus `extra` config lines), once /healthz answers;
    with `dry_run` on the replayed `capture`."""
    cfg = tmp / "config.yaml"
    cfg.write_text(f"daemon: {{state_dir: {tmp / 'state'}}}\nhangs: {{stacks: false}}\n{extra}")
    cmd = [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)]
    cmd += ["--listen", f"127.0.0.1:{port}"]
    if dry_run:
        cmd += ["--nvml-replay", str(capture)]
    with open(tmp / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).close()
            break
        except OSError:
            if daemon.poll() is not None:
                break
            time.sleep(0.5)
    return daemon


def make_cgroup(pid: int, memory_max: str) -> Path:
    """A new cgroup v2 with memory.max and no swap, holding `pid`."""
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        raise RuntimeError(f"{CGROUP_ROOT} is not a cgroup v2 hierarchy")
    control = CGROUP_ROOT / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        control.write_text("+memory")
    group = CGROUP_ROOT / f"gpuwatchd-oom-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "memory.max").write_text(memory_max)
    if (group / "memory.swap.max").exists():
        (group / "memory.swap.max").write_text("0")
    (group / "cgroup.procs").write_text(str(pid))
    return group


def remove_cgroup(group: Path) -> str:
    for _ in range(20):
        try:
            group.rmdir()
            return ""
        except OSError as exc:
            err = f"{group}: {exc}"
            time.sleep(0.5)
    return err


def job_env(rank: int, port: int) -> dict[str, str]:
    """The 2-rank job's environment (hang_daemon_e2e's), faulthandler off: a rank's
    own SIGSEGV handler would keep the kernel from logging its segfault."""
    env = shared_job_env(rank, port)
    env.pop("PYTHONFAULTHANDLER", None)
    return env


def firing_hang_alerts(port: int) -> list[dict[str, Any]]:
    alerts = get(port, "/alerts").get("alerts", [])
    return [
        a
        for a in alerts
        if a.get("labels", {}).get("alertname") == "JobHangSuspected"
        and a.get("status") == "firing"
    ]


def names_cause(alert: dict[str, Any]) -> bool:
    cause = str(alert.get("annotations", {}).get("cause", ""))
    return bool(cause) and not cause.startswith("no cause")


def wait_for(deadline: float, probe: Any) -> Any:
    """probe() every POLL s until it returns something truthy or the deadline passes."""
    while time.time() < deadline:
        try:
            got = probe()
            if got:
                return got
        except (OSError, ValueError):
            pass
        time.sleep(POLL)
    return None


def run_scenario(
    name: str, port: int, tmp: Path, out_dir: Path | None, args: argparse.Namespace
) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
    log_dir = out_dir or run_dir
    log_at = (tmp / "daemon.log").stat().st_size
    before = {d.get("id") for d in get(port, "/hangs").get("hangs", [])}
    alerts_before = {a.get("fingerprint") for a in firing_hang_alerts(port)}
    master = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank", name, str(run_dir)]
    cmd += ["--dry-run"] if args.dry_run else []
    logs = [open(log_dir / f"{name}-rank{r}.log", "wb") for r in (0, 1)]  # noqa: SIM115
    ranks = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=job_env(r, master), stdout=logs[r], stderr=subprocess.STDOUT
        )
        for r in (0, 1)
    ]
    for f in logs:
        f.close()
    out: dict[str, Any] = {"victim_pid": ranks[1].pid, "peer_pid": ranks[0].pid}
    keys = ("seconds_to_verdict", "seconds_to_cause", "seconds_to_alert", "seconds_to_resolved")
    out.update(dict.fromkeys(keys))
    out.update(cause="", cause_kind=None, alert_cause="", named_right=False, in_time=False)
    out["names_victim"] = False
    group: Path | None = None
    tap: KmsgTap | None = None
    try:
        ready = wait_for(
            time.time() + args.start_timeout,
            lambda: all((run_dir / f"ready-{r}").exists() for r in (0, 1)),
        )
        if not ready:
            out["error"] = f"the ranks did not step within {args.start_timeout} s"
            return out
        time.sleep(args.warm)
        if name == "oom" and not args.dry_run:
            try:
                group = make_cgroup(ranks[1].pid, args.memory_max)
            except (OSError, RuntimeError) as exc:
                out["error"] = f"no memory cgroup: {type(exc).__name__}: {exc}"
                return out
            out["cgroup"] = str(group)
        early = [d for d in get(port, "/hangs").get("hangs", []) if d.get("id") not in before]
        out["hangs_before_fault"] = [f"{d.get('id')}: {d.get('reason')}" for d in early]
        before |= {d.get("id") for d in early}
        tap = KmsgTap()
        t0 = time.time()
        out["fault_usec"] = kernel_usec()
        (run_dir / "fault").touch()
        out["fault_at"] = t0
        end = t0 + args.deadline

        def new_hang() -> dict[str, Any] | None:
            docs = get(port, "/hangs").get("hangs", [])
            return next((d for d in docs if d.get("id") not in before), None)

        doc = wait_for(end, new_hang)
        if doc is None:
            out["error"] = f"no /hangs record within {args.deadline} s of the fault"
            return out
        out["seconds_to_verdict"] = round(time.time() - t0, 1)
        out["hang_id"] = doc["id"]
        want = KIND[name]

        def caused() -> dict[str, Any] | None:
            d = dict(get(port, f"/hangs?id={doc['id']}"))
            cause = (d.get("causes") or {}).get("cause") or {}
            return d if cause.get("kind") == want else None

        full = wait_for(end, caused)
        if full is not None:
            out["seconds_to_cause"] = round(time.time() - t0, 1)
        else:
            full = dict(get(port, f"/hangs?id={doc['id']}"))
        cause = (full.get("causes") or {}).get("cause") or {}
        out.update(cause=full.get("cause", ""), cause_kind=cause.get("kind"))
        out["causes"] = full.get("causes")
        out.update(incident=full.get("incident", ""), cause_pid=cause.get("pid"))
        out.update({k: full.get(k) for k in ("job", "conditions", "signature", "reason")})
        out["alternatives"] = [
            c.get("text") for c in (full.get("causes") or {}).get("alternatives", [])
        ]

        def fresh_alerts() -> list[dict[str, Any]]:
            alerts = firing_hang_alerts(port)
            return [a for a in alerts if a.get("fingerprint") not in alerts_before]

        def alerted() -> dict[str, Any] | None:
            # the first alert that names a cause ("no cause seen ..." does not count)
            return next((a for a in fresh_alerts() if names_cause(a)), None)

        alert = wait_for(end, alerted)
        if alert is not None:
            out["seconds_to_alert"] = round(time.time() - t0, 1)
        else:
            alert = next(iter(fresh_alerts()), None)  # one that names none, if any
        if alert is not None:
            out["alert_cause"] = alert.get("annotations", {}).get("cause", "")
            out["alert_labels"] = alert.get("labels", {})
        out["named_right"] = out["cause_kind"] == want
        out["names_victim"] = f"pid {ranks[1].pid}" in str(out["cause"])
        out["in_time"] = all(
            out[k] is not None and out[k] <= args.within
            for k in ("seconds_to_verdict", "seconds_to_cause", "seconds_to_alert")
        )
        tap.drain()
        tap.close()  # the records end here: what the job's own end logs is no fault
        for p in ranks:
            if p.poll() is None:
                p.kill()
        t1 = time.time()
        resolved = wait_for(
            t1 + args.resolve_timeout,
            lambda: get(port, f"/hangs?id={doc['id']}").get("resolved_at"),
        )
        out["seconds_to_resolved"] = round(time.time() - t1, 1) if resolved else None
        return out
    finally:
        if tap is not None:
            out["kmsg_records"] = len(tap.drain())
            out["kmsg_error"] = tap.error or None
            (log_dir / f"{name}-kmsg.raw").write_text("".join(r + "\n" for r in tap.records))
            tap.close()
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        out["victim_exit"] = ranks[1].returncode
        if group is not None:
            # the kernel's own words for the kill, for the memory-pressure readers' tests
            files = ("memory.events", "memory.events.local", "memory.pressure", "memory.max")
            out["cgroup_files"] = {f: read(str(group / f)) for f in files}
            out["cgroup_cleanup_error"] = remove_cgroup(group) or None
        if out_dir is not None:
            with open(tmp / "daemon.log", "rb") as f:
                f.seek(log_at)
                (out_dir / f"{name}-daemon.log").write_bytes(f.read())
        print(f"{name} done", file=sys.stderr)


def read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", action="append", choices=SCENARIOS, help="all three if none")
    ap.add_argument("--out-dir", default="", help="result.json and per-scenario logs")
    ap.add_argument("--deadline", type=float, default=60.0, help="wait this long for a verdict")
    ap.add_argument("--within", type=float, default=30.0, help="pass: cause and alert by then")
    ap.add_argument("--warm", type=float, default=15.0, help="seconds of steps before the fault")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--resolve-timeout", type=float, default=30.0)
    ap.add_argument("--memory-max", default="600M", help="oom: the cgroup's memory.max")
    ap.add_argument("--dry-run", action="store_true", help="fake ranks, replayed NVML, no cgroup")
    ap.add_argument("--rank", nargs=2, metavar=("SCENARIO", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        return rank_main(args.rank[0], Path(args.rank[1]), args.dry_run)
    names = args.scenario or list(SCENARIOS)
    out_dir = Path(args.out_dir).resolve() if args.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": args.dry_run,
        "exception_trace": read("/proc/sys/debug/exception-trace"),
        "gpu_bus_id": "" if args.dry_run else gpu_bus_id(),
        "scenarios": {},
    }
    problem = "" if args.dry_run else no_gpu()
    if problem:
        result["error"] = problem
        print(json.dumps(result, indent=1))
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-cause-kills-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        daemon = start_daemon(tmp, port, args.dry_run)
        try:
            for name in names:
                try:
                    result["scenarios"][name] = run_scenario(name, port, tmp, out_dir, args)
                except Exception as exc:  # one scenario's failure is reported, not fatal
                    result["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
            result["daemon_exit"] = daemon.returncode
            if out_dir is not None:
                (out_dir / "daemon.log").write_bytes((tmp / "daemon.log").read_bytes())
    result["seconds"] = round(time.time() - started, 1)
    result["ok"] = all(
        s.get("named_right") and s.get("in_time") for s in result["scenarios"].values()
    )
    if out_dir is not None:
        result["fixture"] = str(write_fixture(out_dir, result))
    text = json.dumps(result, indent=1, default=str)
    if out_dir is not None:
        (out_dir / "result.json").write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
