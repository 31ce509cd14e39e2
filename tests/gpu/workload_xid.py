#!/usr/bin/env python3
"""On a real GPU: two ranks of one fake job fault the same GPU 10 s apart; both are attributed.

Starts `python -m gpuwatchd run` with the default config (real NVML, the
real kernel log; only the listen address and state directory are set),
waits until its kernel log reader has caught up, then starts two child
processes with a torch.distributed-style environment (RANK 0 and 1,
WORLD_SIZE 2, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, plus a secret that
must never show up). Each one opens a CUDA context, waits --settle seconds
(so NVML lists it and the workloads source places it), then stores to an
unmapped address (Xid 31, the PTX helper in faults.py) and stays alive. The
second faults --gap (10) seconds after the first, inside the default 60 s
burst window: two processes, so two faults. The script then reads /events
and /alerts and prints one JSON object showing, for each child, the stored
event's pid, rank and workload, and the alert's labels and annotations.

Run from the repository root, as root, on a machine with an NVIDIA GPU:

    sudo .venv/bin/python tests/gpu/workload_xid.py [--gap 10] [--settle 21] [--out result.json]

Exit status 0 when both events are there, each with its own pid, rank and
workload, each stored once (count 1), logged once, the Xid error counter rose
by 2, and the secret appears nowhere; 1 when something did not hold; 2 when
there is no GPU or the daemon could not start (the JSON says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECRET = "gpuwatchd-secret-must-not-leak"


def hold_context() -> None:
    """Open a CUDA context on device 0, so NVML lists this process before it faults."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for name, args in (
        ("cuInit", (0,)),
        ("cuDeviceGet", (ctypes.byref(dev), 0)),
        ("cuCtxCreate_v2", (ctypes.byref(ctx), 0, dev)),
    ):
        rc = int(getattr(cuda, name)(*args))
        if rc != 0:
            raise RuntimeError(f"{name} returned CUresult {rc}")


def fault_child(rank: int, settle: float) -> int:
    """Runs in a child: hold a context for `settle` s, fault GPU 0, report, stay alive."""
    from faults import illegal_write_ptx

    try:
        hold_context()
        time.sleep(settle)  # the NVML and workloads sources see the process meanwhile
        result: dict[str, Any] = illegal_write_ptx()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result.update(rank=rank, pid=os.getpid())
    print(json.dumps(result), flush=True)
    time.sleep(60)  # the parent kills us; meanwhile NVML and /proc still show the process
    return 0


def torch_env(rank: int) -> dict[str, str]:
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        TORCHELASTIC_RUN_ID="gpuwatchd-workload-xid",
        HF_TOKEN=SECRET,
    )


def preflight() -> str:
    """Why this cannot run here, or "" when it can."""
    if not os.path.exists("/dev/kmsg"):
        return "no /dev/kmsg"
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no NVIDIA driver (libcuda.so.1): {exc}"
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"NVML unavailable: {exc}"
    if count < 1:
        return "no GPU"
    if os.geteuid() != 0:
        return "needs root (reads /dev/kmsg, other users' /proc/PID/environ)"
    return ""


def xid31_total(text: str, samples: Any) -> float:
    return sum(v for _, v in samples(text, "gpuwatchd_xid_errors_total") if _.get("xid") == "31")


def run(args: argparse.Namespace, result: dict[str, Any]) -> int:
    from xid31_e2e import free_port, get, samples

    state = tempfile.mkdtemp(prefix="gpuwatchd-workload-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(state) / "daemon.log"
    log = open(log_path, "w+")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "gpuwatchd", "run", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--state-dir", state]
    result["daemon_command"] = " ".join(cmd[1:])
    daemon = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    children: list[subprocess.Popen[str]] = []
    try:
        ready_by, last, stable = time.monotonic() + 90, -1.0, time.monotonic()
        while True:
            if daemon.poll() is not None:
                result["error"] = "daemon exited early"
                return 2
            status, text = get(url + "/metrics")
            read = sum(v for _, v in samples(text, "gpuwatchd_kmsg_records_read_total"))
            if read != last:
                last, stable = read, time.monotonic()
            up = samples(text, "gpuwatchd_kmsg_reader_up") if status == 200 else []
            if up and up[0][1] == 1 and time.monotonic() - stable > 1.0:
                break
            if time.monotonic() > ready_by:
                result["error"] = f"daemon not ready (/metrics {status})"
                return 2
            time.sleep(0.2)
        before = xid31_total(get(url + "/metrics")[1], samples)

        for rank in (0, 1):  # same settle time each: the faults come `gap` seconds apart
            if rank:
                time.sleep(args.gap)
            child = subprocess.Popen(
                [sys.executable, __file__, "--child", str(rank), "--settle", str(args.settle)],
                cwd=ROOT,
                env=torch_env(rank),
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(child)
        faults = []
        for child in children:
            assert child.stdout is not None
            faults.append(json.loads(child.stdout.readline() or "{}"))
        result["faults"] = faults
        if all("launched_at" in f for f in faults):
            result["seconds_between_faults"] = round(
                faults[1]["launched_at"] - faults[0]["launched_at"], 3
            )
        pids = {f.get("pid") for f in faults}

        # both events stored and attributed (the store and /events see them within seconds)
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = get(url + "/events?code=31&limit=50")
            if status == 200:
                events = [e for e in json.loads(body)["events"] if _pid(e) in pids]
                if len({_pid(e) for e in events}) == 2:
                    break
            time.sleep(0.5)
        result["events"] = [_summary(e) for e in events]
        after = xid31_total(get(url + "/metrics")[1], samples)
        result["xid31_errors_total_delta"] = after - before

        alerts: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = get(url + "/alerts")
            if status == 200:
                alerts = [
                    a
                    for a in json.loads(body).get("alerts", [])
                    if a.get("labels", {}).get("xid") == "31"
                ]
                if alerts:
                    break
            time.sleep(0.5)
        result["alerts_status"] = status
        result["alerts"] = [
            {"labels": a.get("labels"), "annotations": a.get("annotations")} for a in alerts
        ]
        status, body = get(url + "/status")
        if status == 200:
            result["status_workloads"] = json.loads(body)["sources"].get("workloads")
    finally:
        for child in children:
            child.kill()
            child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        daemon.terminate()
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.seek(0)
        lines = log.read().splitlines()
        result["daemon_log_xid_lines"] = [ln for ln in lines if "Xid 31 on " in ln]
        log.close()

    by_pid = {_pid(e): e for e in events}
    checks = {
        "both_faults_illegal_address": all(f.get("synchronize") == 700 for f in faults),
        "two_events_two_pids": len(by_pid) == 2,
        "workload_on_both": all(
            by_pid.get(f.get("pid"), {}).get("attrs", {}).get("workload") for f in faults
        ),
        "one_job_for_both_ranks": {
            by_pid.get(f.get("pid"), {}).get("attrs", {}).get("workload_id") for f in faults
        }
        == {"torchelastic:gpuwatchd-workload-xid"},
        "ranks_match": all(
            str(by_pid.get(f.get("pid"), {}).get("attrs", {}).get("rank")) == str(f["rank"])
            for f in faults
        ),
        "each_counted_once": all(e.get("count") == 1 for e in events),
        "error_counter_rose_by_2": result["xid31_errors_total_delta"] == 2,
        "logged_twice": len(result["daemon_log_xid_lines"]) == 2,
        "secret_nowhere": SECRET not in json.dumps(result) and SECRET not in log_path.read_text(),
    }
    result["checks"] = checks
    return 0 if all(checks.values()) else 1


def _pid(e: dict[str, Any]) -> int | None:
    text = str(e.get("attrs", {}).get("pid") or e.get("pid") or "")
    return int(text) if text.isdigit() else None


def _summary(e: dict[str, Any]) -> dict[str, Any]:
    attrs = e.get("attrs", {})
    keep = ("pid", "process", "rank", "local_rank", "world_size", "torchelastic_run_id")
    keep += ("workload", "workload_id", "attribution", "slurm_job", "pod", "namespace", "uuid")
    return {
        "time": e.get("time"),
        "count": e.get("count"),
        "message": e.get("message"),
        **{k: attrs[k] for k in keep if k in attrs},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gap", type=float, default=10.0, help="seconds between the two faults")
    parser.add_argument(
        "--settle",
        type=float,
        default=21.0,
        help="seconds each child holds a context before it faults (NVML, then the workloads"
        " source, must each poll once: every 10 s by default)",
    )
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return fault_child(args.child, args.settle)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": os.uname().nodename,
        "kernel": os.uname().release,
    }
    why = preflight()
    if why:
        result["error"] = why
        rc = 2
    else:
        try:
            rc = run(args, result)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            rc = 1
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
