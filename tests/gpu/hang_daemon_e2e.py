#!/usr/bin/env python3
"""On a real GPU: the daemon itself (`gpuwatchd run`) flags the hang scenarios.

Starts `python -m gpuwatchd run` as a user would (real NVML, real kernel log,
default intervals; only the listen address, the state directory and the
opt-in stack capture are set), then runs two jobs from hang_jobs.py one after
the other and polls /hangs once a second:

1. rank missing at start: WORLD_SIZE=2, only rank 0 runs init_process_group;
2. peer death: two ranks spin on flags they share through CUDA IPC; rank 1
   is killed with SIGKILL after --peer-settle seconds.

Prints one JSON object with, per scenario, the seconds from launch (or from
the kill) to the first /hangs record, the signature, the missing ranks,
where each rank is stuck, the alert that reached the daemon's hang alert
sink, and `gpuwatchd hang show` for it. Run from the repository root, as
root, on a machine with an NVIDIA GPU, PyTorch and py-spy:

    python3 tests/gpu/hang_daemon_e2e.py [--out result.json]

Exit status 0 when both scenarios are flagged within --deadline (60) seconds
with the expected signature, 1 otherwise, 2 when there is no GPU.

One scenario, recorded as a CI fixture (`hangs.stacks` on, py-spy needed):

    python3 tests/gpu/hang_daemon_e2e.py --scenario remote-rank-missing --record DIR
    python3 tests/gpu/hang_daemon_e2e.py --scenario kernel-never-ends --record DIR

runs the daemon and one scenario of tests/gpu/nccl_scenarios.py on one GPU
(remote-rank-missing: rank 0 of WORLD_SIZE=2 with LOCAL_WORLD_SIZE=1, rank 1 never
started; kernel-never-ends: one process whose CUDA graph kernel spins forever, the
host in a synchronize), the harness reading /hangs and /alerts every 0.5 s; then
turns the recording into a fixture (tests/gpu/scenario_fixture.py, replayed at once).
Prints one JSON object (also DIR/result.json): seconds from the hang's start to the
verdict (first /hangs record) and to the alert (first JobHangSuspected in /alerts),
the conditions, signature, reason and where; DIR/run/ holds the harness's output,
DIR/fixture/NAME the fixture to copy into tests/fixtures/hangs/, DIR/daemon.log the
daemon's log. Exit 0 when verdict and alert came within --deadline (30) s with the
expected signature. --dry-run: fake ranks (no GPU, nothing to flag), the daemon on a
replayed NVML capture: the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
JOBS = str(HERE / "hang_jobs.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def wait_hang(port: int, since_ids: set[int], deadline: float) -> dict[str, Any] | None:
    """The first /hangs record not in since_ids, polled once a second until deadline."""
    while time.time() < deadline:
        try:
            for doc in get(port, "/hangs").get("hangs", []):
                if doc.get("id") not in since_ids:
                    return dict(doc)
        except OSError:
            pass
        time.sleep(1.0)
    return None


def hang_ids(port: int) -> set[int]:
    return {d.get("id") for d in get(port, "/hangs").get("hangs", [])}


def job_env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NCCL_NVLS_ENABLE="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def scenario(name: str, port: int, state: Path, deadline_s: float, start: Any) -> dict[str, Any]:
    before = hang_ids(port)
    procs, t0 = start()
    try:
        doc = wait_hang(port, before, t0 + deadline_s + 30)
        seen = time.time()
        out: dict[str, Any] = {"flagged": doc is not None}
        if doc is not None:
            out["seconds_to_detection"] = round(seen - t0, 1)
            # the forensics worker matches the signature a moment after the verdict
            for _ in range(30):
                full = get(port, f"/hangs?id={doc.get('id')}")
                if full.get("signature"):
                    break
                time.sleep(0.5)
            out["seconds_to_signature"] = round(time.time() - t0, 1)
            out["hang"] = {k: v for k, v in full.items() if k not in ("stacks", "ras")}
            out["hang_detail_keys"] = sorted(full)
            show = subprocess.run(
                [sys.executable, "-m", "gpuwatchd", "hang", "show", "--state-dir", str(state)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=30,
            )
            out["hang_show"] = (show.stdout + show.stderr)[-4000:]
            time.sleep(3)
            out["metrics_job_hang_info"] = [
                line
                for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
                .splitlines()
                if line.startswith("gpuwatchd_job_hang_info")
            ]
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        print(f"{name} done", file=sys.stderr)


# --scenario: the harness's scenario, the signature and the condition it must page with
RECORDED = {
    "remote-rank-missing": ("remote_rank_missing", "rendezvous_missing_rank", "rank_missing"),
    "kernel-never-ends": ("kernel_never_ends", "kernel_never_completes", "kernel_stuck"),
}
REPLAYED_CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h100-record.json"


def find_py_spy() -> str | None:
    """py-spy on PATH, beside this Python, or where multi_gpu_session.sh installs wheels."""
    for path in (
        shutil.which("py-spy"),
        str(Path(sys.executable).parent / "py-spy"),
        "/tmp/site/bin/py-spy",
    ):
        if path and os.access(path, os.X_OK):
            return path
    return None


def start_daemon(
    tmp: Path, port: int, env: dict[str, str], dry_run: bool
) -> subprocess.Popen[bytes]:
    """`gpuwatchd run` on its defaults plus the stacks (and, dry, a replayed NVML)."""
    state = tmp / "state"
    cfg = tmp / "config.yaml"
    cfg.write_text(f"daemon: {{state_dir: {state}}}\nhangs: {{stacks: true}}\n")
    cmd = [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)]
    cmd += ["--listen", f"127.0.0.1:{port}"]
    if dry_run:
        cmd += ["--nvml-replay", str(REPLAYED_CAPTURE)]
    log = open(tmp / "daemon.log", "w")  # noqa: SIM115 - the child holds it
    daemon = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    return daemon


def no_gpu() -> str:
    """'' when NVML answers, else why not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"no GPU: {type(exc).__name__}: {exc}"
    return ""


def recorded(args: argparse.Namespace) -> int:
    """One scenario beside the daemon, recorded and turned into a fixture."""
    name, signature, condition = RECORDED[args.scenario]
    out = Path(args.record).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    spy = find_py_spy()
    if spy:
        env["PATH"] = f"{Path(spy).parent}:{env.get('PATH', '')}"
    result: dict[str, Any] = {
        "scenario": args.scenario,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "py_spy": spy,
        "dry_run": args.dry_run,
    }
    problem = "" if args.dry_run else no_gpu()
    if not spy and not args.dry_run:
        problem = "no py-spy: the early stacks need it (pip install py-spy==0.4.2)"
    if problem:
        result["error"] = problem
        print(json.dumps(result, indent=1))
        return 2
    run = out / "run"
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-hang-rec-") as tmp:
        port = free_port()
        daemon = start_daemon(Path(tmp), port, env, args.dry_run)
        cmd = [sys.executable, str(HERE / "nccl_scenarios.py"), "--out", str(run)]
        cmd += ["--daemon-url", f"http://127.0.0.1:{port}", "--daemon-poll", "0.5"]
        cmd += ["--gpus", "1", "--hang-seconds", str(args.hang_seconds), name]
        if args.dry_run:
            cmd += ["--dry-run", "--settle", "1", "--warm", "1", "--startup-timeout", "30"]
        try:
            harness = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.budget
            )
            result["harness_exit"] = harness.returncode
            result["harness_tail"] = (harness.stdout + harness.stderr).splitlines()[-15:]
        except subprocess.TimeoutExpired:
            result["harness_exit"] = "timeout"
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)
            result["daemon_exit"] = daemon.returncode
            shutil.copyfile(Path(tmp) / "daemon.log", out / "daemon.log")
    rows = []
    if (run / "summary.json").exists():
        rows = json.loads((run / "summary.json").read_text()).get("rows", [])
    row = next((r for r in rows if r.get("scenario") == name), {})
    keys = ("flagged", "severity", "conditions", "signals", "signature", "reason", "where")
    result["seconds_to_verdict"] = row.get("detected_after_s")
    result["seconds_to_alert"] = row.get("alert_after_s")
    result.update({k: row.get(k) for k in (*keys, "missing", "pyspy_ok", "notes")})
    result["recording"] = str(run / name)
    if (run / name / "trace.json").exists():
        sys.path.insert(0, str(HERE))
        from scenario_fixture import check, convert

        fixture = out / "fixture" / f"{args.scenario}-{args.fixture_suffix}"
        got = convert(str(run / name), str(fixture), from_summary=True)
        result["fixture"] = str(fixture)
        result["fixture_warnings"] = got["warnings"]
        try:
            result["replay_misses"] = check(str(fixture))
        except Exception as e:  # a recording the replay cannot read: say so, keep the files
            result["replay_misses"] = [f"replay failed: {type(e).__name__}: {e}"]
    in_time = [
        result.get(k) is not None and result[k] <= args.deadline
        for k in ("seconds_to_verdict", "seconds_to_alert")
    ]
    result["ok"] = bool(
        all(in_time)
        and result.get("signature") == signature
        and condition in (result.get("conditions") or [])
    )
    text = json.dumps(result, indent=1, default=str)
    (out / "result.json").write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deadline", type=float, default=None, help="60 s; 30 s with --scenario")
    ap.add_argument("--peer-settle", type=float, default=25.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--scenario", choices=sorted(RECORDED), help="one scenario, recorded")
    ap.add_argument("--record", default="", help="with --scenario: the output directory")
    ap.add_argument("--hang-seconds", type=float, default=75.0, help="watch the hang this long")
    ap.add_argument("--budget", type=float, default=400.0, help="the harness's deadline")
    ap.add_argument("--fixture-suffix", default="1xgpu", help="fixture NAME: SCENARIO-SUFFIX")
    ap.add_argument("--dry-run", action="store_true", help="with --scenario: fake ranks, no GPU")
    args = ap.parse_args(argv)
    if args.scenario:
        if not args.record:
            ap.error("--scenario needs --record DIR")
        args.deadline = 30.0 if args.deadline is None else args.deadline
        return recorded(args)
    args.deadline = 60.0 if args.deadline is None else args.deadline
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as exc:
        print(json.dumps({"error": "no GPU", "detail": str(exc)}))
        return 2
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-hang-e2e-") as tmp:
        state = Path(tmp) / "state"
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(f"daemon: {{state_dir: {state}}}\nhangs: {{stacks: true}}\n")
        port = free_port()
        log = open(Path(tmp) / "daemon.log", "w")  # noqa: SIM115 - closed below
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)]
            + ["--listen", f"127.0.0.1:{port}"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            for _ in range(120):
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                        break
                except OSError:
                    time.sleep(0.5)

            def rendezvous() -> tuple[list[subprocess.Popen[bytes]], float]:
                t0 = time.time()
                p = subprocess.Popen(
                    [sys.executable, JOBS, "rendezvous"],
                    env=job_env(0, 29633),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                return [p], t0

            def peer_death() -> tuple[list[subprocess.Popen[bytes]], float]:
                d = tempfile.mkdtemp(prefix="peer-", dir=tmp)
                ps = [
                    subprocess.Popen(
                        [sys.executable, JOBS, "peer", str(r), d],
                        env=job_env(r, 29644),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for r in (0, 1)
                ]
                time.sleep(args.peer_settle)
                os.kill(ps[1].pid, signal.SIGKILL)
                return ps, time.time()

            result["rank_missing_at_start"] = scenario(
                "rendezvous", port, state, args.deadline, rendezvous
            )
            time.sleep(5)
            result["peer_death"] = scenario("peer", port, state, args.deadline, peer_death)
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
            log.close()
            text = (Path(tmp) / "daemon.log").read_text(errors="replace")
            result["daemon_log_tail"] = text.splitlines()[-40:]
            result["daemon_exit"] = daemon.returncode
    ok = True
    want = {"rank_missing_at_start": "rendezvous", "peer_death": "dead_peer"}
    for key, frag in want.items():
        r = result[key]
        sig = str(r.get("hang", {}).get("signature", ""))
        r["signature_ok"] = frag in sig
        r["in_time"] = r.get("seconds_to_detection", 1e9) <= args.deadline
        ok = ok and r["flagged"] and r["signature_ok"] and r["in_time"]
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
