"""One scenario of nccl_scenarios.py on GPUs of its own: launch, markers, act, observe, kill."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from nccl_observe import (
    nvml_window,
    proc_sample,
    pyspy,
    ras_raw,
    summary_row,
    task_cpu_seconds,
    trigger_flight_recorder,
)
from nccl_plan import SCENARIOS, Scenario
from nccl_rank import MULTICAST_OFF

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "nccl_jobs.py")
FR_AFTER_S = 50.0  # the harness's flight recorder ask, when the daemon has not flagged
RUN = "torch.distributed.run"  # torchrun, where the script is not on PATH


class Run:
    """One scenario: launch, wait for markers, act, observe, kill, write trace.json."""

    def __init__(self, s: Scenario, gpus: list[int], args: argparse.Namespace, ctx: Any) -> None:
        self.s, self.gpus, self.args, self.ctx = s, gpus, args, ctx
        self.idx = SCENARIOS.index(s)
        self.dir = os.path.join(args.out, s.name)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.trace: dict[str, Any] = {
            "scenario": asdict(s),
            "gpus": gpus,
            "devices": [args.devices[g] for g in gpus],
            "samples": [],
            "ras": [],
            "pyspy": [],
            "notes": [],
        }
        self.ras_busy = threading.Lock()
        self.spy_lock = threading.Lock()

    # --- launching ------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        fr = os.path.join(self.dir, "fr")
        os.makedirs(fr, exist_ok=True)
        env = dict(os.environ)
        env.update(MULTICAST_OFF)
        env.update(
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="2",
            CUDA_VISIBLE_DEVICES=",".join(self.args.devices[g] for g in self.gpus),
            # indices as nvidia-smi and NVML number them (the default is fastest first)
            CUDA_DEVICE_ORDER=os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
            NCCL_RAS_ADDR=f"127.0.0.1:{self.args.ras_port_base + self.idx}",
            # both spellings: releases read the TORCH_NCCL_ or the newer TORCH_FR_ names
            TORCH_NCCL_DEBUG_INFO_PIPE_FILE=os.path.join(fr, "pipe_"),
            TORCH_FR_DEBUG_INFO_PIPE_FILE=os.path.join(fr, "pipe_"),
            TORCH_NCCL_DEBUG_INFO_TEMP_FILE=os.path.join(fr, "dump_"),
            TORCH_FR_DUMP_TEMP_FILE=os.path.join(fr, "dump_"),
            TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
            TORCH_FR_BUFFER_SIZE="2000",
            TORCH_NCCL_DUMP_ON_TIMEOUT="1",
        )
        return env

    def job_args(self) -> list[str]:
        s, a = self.s, self.args
        out = [s.mode, "--dir", self.dir, "--seconds", str(s.phase(a.control_seconds))]
        out += ["--warm", str(a.warm), "--scratch", a.scratch]
        return out + (["--fake"] if a.dry_run else [])

    def launch(self) -> None:
        s, env = self.s, self.env()
        if s.launch == "torchrun":
            if self.args.dry_run:
                cmd = [sys.executable, JOBS, "fake-torchrun", str(s.gpus), *self.job_args()]
            else:
                run = ["torchrun"] if shutil.which("torchrun") else [sys.executable, "-m", RUN]
                cmd = [*run, "--standalone", f"--nproc-per-node={s.gpus}", JOBS]
                cmd += self.job_args()
            self._spawn(cmd, env, "launcher")
        else:
            alone = s.launch in ("hand_rank0", "remote_rank0")  # rank 0 of 2, rank 1 never starts
            world = 2 if alone else s.gpus
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self.args.master_port_base + self.idx),
                WORLD_SIZE=str(world),
                # remote_rank0: the missing rank belongs to another node
                LOCAL_WORLD_SIZE="1" if s.launch == "remote_rank0" else str(world),
            )
            for r in range(1 if alone else world):
                env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
                self._spawn([sys.executable, JOBS, *self.job_args()], env_r, f"rank{r}")
        self.trace["commands"] = [" ".join(p.args) for p in self.procs]  # type: ignore[arg-type]

    def _spawn(self, cmd: list[str], env: dict[str, str], tag: str) -> None:
        log = open(os.path.join(self.dir, f"{tag}.log"), "wb")
        p = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs.append(p)

    # --- markers --------------------------------------------------------------------

    def markers(self, name: str) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.s.gpus):
            try:
                with open(os.path.join(self.dir, "markers", f"{name}.rank{r}.json")) as f:
                    out[r] = json.load(f)
            except (OSError, ValueError):
                pass
        return out

    def launcher_gone(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def ranks(self) -> dict[int, int]:
        pids: dict[int, int] = {}
        for name in ("start", "ready", "hang"):
            for r, m in self.markers(name).items():
                pids.setdefault(r, int(m["pid"]))
        return pids

    # --- the scenario ---------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        os.makedirs(self.dir, exist_ok=True)
        t0 = time.time()
        self.trace["t_launch"] = t0
        try:
            self.launch()
            self.observe(t0)
        except Exception as e:  # keep going with the other scenarios; say what broke
            self.trace["notes"].append(f"harness error: {type(e).__name__}: {e}")
        finally:
            self.kill()
        self.finish(t0)
        return summary_row(self.trace)

    def observe(self, t0: float) -> None:
        s, a, stop = self.s, self.args, self.ctx.stop
        alone = s.launch in ("hand_rank0", "remote_rank0")
        want = "hang" if alone else "ready"
        need = 1 if alone else s.gpus
        hang_start: float | None = None
        acted = 0.0
        window_start: float | None = None  # a control's pause (checkpoint, evaluation)
        ready_at: float | None = None
        fr_done = spy_done = 0
        flagged_at: float | None = None  # seconds from the hang's start to the daemon's flag
        next_ras = 0.0
        end = t0 + a.startup_timeout + s.estimate(a.hang_seconds, a.control_seconds, a.settle)
        while not stop.is_set():
            now = time.time()
            if ready_at is None:
                if len(self.markers(want)) >= need:
                    ready_at = now
                    self.trace["t_ready"] = now
                    self.trace["ranks"] = self.ranks()
                    self.trace["job_key"] = self.job_key()
                    if s.kind == "hang":
                        end = now + (a.settle if s.action else 0) + a.hang_seconds + 60
                elif now - t0 > a.startup_timeout or self.launcher_gone():
                    self.trace["notes"].append(f"no {want} marker from {need} rank(s)")
                    return
            ranks = self.ranks()
            self.sample(now, ranks)
            if ready_at is not None:
                if s.action and not acted and now - ready_at >= a.settle:
                    acted = now
                    hang_start = self.act(ranks)
                    if hang_start is not None:
                        end = min(end, hang_start + a.hang_seconds)
                marked = s.kind == "hang" and s.action != "kill1" and (acted or not s.action)
                if hang_start is None and marked:
                    hangs = self.markers("hang")
                    if hangs:
                        hang_start = min(m["t"] for m in hangs.values())
                        what = {m.get("what", "") for m in hangs.values()}
                        self.trace["hang_what"] = sorted(what)
                        end = min(end, hang_start + a.hang_seconds)
                if window_start is None and s.mode in ("checkpoint", "eval_pause"):
                    ph = [m for m in self.markers("phase").values() if m.get("phase") == s.mode]
                    window_start = min((m["t"] for m in ph), default=None)
                # healthy controls get the same dumps 20-30 s after ready (a baseline)
                plain = s.kind == "control" and s.mode not in ("checkpoint", "eval_pause")
                since = hang_start or window_start or (ready_at if plain else None)
                # The dump is the rank's I/O: asked early it would read as the job's
                # progress to the daemon beside us (the daemon discounts only its own
                # asks). So once the daemon flagged, else late in the watch.
                fr_at = FR_AFTER_S if flagged_at is None else min(FR_AFTER_S, flagged_at + 3)
                if since is not None and fr_done == 0 and now - since >= fr_at:
                    fr_done = 1
                    self.trace["fr_triggers"] = trigger_flight_recorder(
                        os.path.join(self.dir, "fr", "pipe_")
                    )
                if since is not None and spy_done < 2 and now - since >= 25 + 5 * spy_done:
                    spy_done += 1
                    pids = [p for p in ranks.values() if proc_sample(p).get("alive")]
                    threading.Thread(target=self.spy, args=(pids, spy_done), daemon=True).start()
                if now >= next_ras and now - ready_at >= 3:
                    next_ras = now + 5
                    threading.Thread(target=self.ras, daemon=True).start()
            if hang_start is not None and self.ctx.daemon and not a.full_hangs:
                # flagged: keep watching 20 s for the forensics, at least 40 s in all
                det = self.ctx.daemon.detection(self.match, hang_start - 5, now)
                if det.get("flagged"):
                    if flagged_at is None:  # the dump goes 3 s later: watch it land
                        flagged_at = det["first_seen"] - hang_start
                        end = min(end, max(hang_start + 40, det["first_seen"] + 20, now + 12))
            self.trace["hang_start"] = hang_start
            self.trace["window_start"] = window_start
            if now >= end:
                if s.kind == "control":
                    self.trace["notes"].append("control still running at its deadline")
                return
            if self.launcher_gone():
                if s.kind == "hang":  # torchrun tore the job down, or the hang never came
                    self.trace["notes"].append(f"job ended at +{now - t0:.0f} s")
                return
            stop.wait(max(0.0, 1.0 - (time.time() - now)))

    def act(self, ranks: dict[int, int]) -> float | None:
        if self.s.action == "kill1" and 1 in ranks:
            os.kill(ranks[1], signal.SIGKILL)
            t = time.time()
            self.trace["hang_what"] = [f"SIGKILL rank 1 (pid {ranks[1]})"]
            return t
        if self.s.action == "kill1":
            self.trace["notes"].append("no pid for rank 1: nothing killed")
        if self.s.action == "go":
            open(os.path.join(self.dir, "go"), "w").close()
            self.trace["go_at"] = time.time()
        return None

    def job_key(self) -> str:
        """The daemon's name for this job, from rank 0's environment.

        Keeps each rank's launcher variables (what the daemon's job view reads) in the trace.
        """
        pid = self.ranks().get(0)
        try:
            from gpuwatchd.sources.hangs.jobs import job_key, read_environ

            self.trace["environ"] = {str(r): read_environ(p) for r, p in self.ranks().items()}
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
            return job_key(int(pid or 0), {k.decode(): v.decode() for k, v in pairs})
        except Exception as e:
            return f"unknown ({type(e).__name__})"

    def match(self, doc: dict[str, Any]) -> bool:
        """Whether a /hangs record (or an alert's labels) is about this scenario's job."""
        key = self.trace.get("job_key", "")
        if key and key in (doc.get("job"), (doc.get("labels") or {}).get("job")):
            return True
        pids = set(self.trace.get("ranks", {}).values())
        return any(r.get("pid") in pids for r in doc.get("ranks") or [])

    def sample(self, now: float, ranks: dict[int, int]) -> None:
        row: dict[str, Any] = {"t": round(now, 3), "ranks": {}}
        for r, pid in ranks.items():
            row["ranks"][str(r)] = {"pid": pid, **proc_sample(pid)}
            row["ranks"][str(r)]["task_cpu_s"] = task_cpu_seconds(pid)
        row["launchers"] = {str(p.pid): p.poll() for p in self.procs}
        self.trace["samples"].append(row)

    def ras(self) -> None:
        if not self.ras_busy.acquire(blocking=False):
            return  # never more than one query in flight per job
        try:
            addr = f"127.0.0.1:{self.args.ras_port_base + self.idx}"
            self.trace["ras"].append(ras_raw(addr, "json"))
            if len(self.trace["ras"]) % 4 == 1:
                self.trace["ras"].append(ras_raw(addr, "text", verbose=True))
        finally:
            self.ras_busy.release()

    def spy(self, pids: list[int], n: int) -> None:
        with self.spy_lock:  # one py-spy round at a time: two would fight over ptrace
            self.trace["pyspy"].extend(pyspy(pids, self.dir, f"{n}", timeout=20.0))

    # --- the end --------------------------------------------------------------------

    def kill(self) -> None:
        """SIGTERM each child's session, then SIGKILL; ranks by pid too, bounded."""
        ranks = self.ranks()
        starts = {pid: proc_sample(pid).get("starttime") for pid in ranks.values()}
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except OSError:
                        pass
            for pid, start in starts.items():
                if start is not None and proc_sample(pid).get("starttime") == start:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and not self.launcher_gone():
                time.sleep(0.2)
        self.trace["exit_codes"] = {str(p.pid): p.poll() for p in self.procs}
        left = [
            pid
            for pid, st in starts.items()
            if (now := proc_sample(pid)).get("alive") and now.get("starttime") == st
        ]
        if left or not self.launcher_gone():
            self.trace["notes"].append(f"still alive after SIGKILL: {left}")

    def finish(self, t0: float) -> None:
        t_end = time.time()
        self.trace["t_end"] = t_end
        fr = os.path.join(self.dir, "fr")
        os.makedirs(fr, exist_ok=True)
        self.trace["fr_files"] = {
            n: os.path.getsize(os.path.join(fr, n))
            for n in sorted(os.listdir(fr))
            if not n.endswith(".pipe")
        }
        self.trace["markers"] = {
            n: self.markers(n)
            for n in ("start", "ready", "phase", "hang", "faulted", "returned", "done")
        }
        self.trace["kmsg"] = self.ctx.kmsg.between(t0, t_end + 2)
        # GPU activity beside the /proc samples: what a detector replay needs, in one file
        self.trace["nvml"] = nvml_window(self.ctx.nvml.rows, self.trace["devices"], t0, t_end)
        self.trace["nvml_error"] = self.ctx.nvml.error
        det = self.ctx.daemon.detection(self.match, t0, t_end + 2) if self.ctx.daemon else {}
        start = self.trace.get("hang_start") or self.trace.get("window_start") or t0
        for k in ("first_seen", "alert_first_seen"):
            if k in det:
                det[k.replace("first_seen", "after_s")] = round(det[k] - start, 1)
        self.trace["daemon"] = det
        with open(os.path.join(self.dir, "trace.json"), "w") as f:
            json.dump(self.trace, f, indent=1, default=str)
