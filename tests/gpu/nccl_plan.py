"""The scenario table of tests/gpu/nccl_scenarios.py and the schedule it follows.

Each scenario runs on GPUs of its own; the harness starts the widest and
longest first and fills free GPUs as jobs end (`--plan` prints the result
on estimated durations).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

STARTUP = 25.0  # torch import, CUDA and NCCL start, warm-up (estimate)


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: str
    kind: str  # hang | control
    launch: str = "torchrun"  # torchrun | hand | hand_rank0 | remote_rank0
    gpus: int = 2
    action: str = ""  # kill1: SIGKILL rank 1; go: touch DIR/go (rank 1 faults)
    seconds: float = 0.0  # the job's main phase (controls); 0 = --control-seconds
    extra: float = 0.0  # known start-up or trailing work beyond the phase

    def phase(self, control_s: float) -> float:
        """The job's main phase: its own length, at most --control-seconds."""
        return min(self.seconds or control_s, control_s)

    def estimate(self, hang_s: float, control_s: float, settle: float) -> float:
        if self.kind == "hang":
            return STARTUP + (settle if self.action else 0) + hang_s + 10
        return STARTUP + self.phase(control_s) + self.extra + 10


SCENARIOS = [
    Scenario("dead_peer", "dead_peer", "hang", launch="hand", action="kill1"),
    Scenario("dead_peer_torchrun", "dead_peer", "hang", action="kill1"),
    Scenario("xid_kill", "xid_kill", "hang", launch="hand", action="go"),
    # rank 0 of WORLD_SIZE=2 with LOCAL_WORLD_SIZE=1: its peer belongs to another node
    Scenario("remote_rank_missing", "remote_rank_missing", "hang", launch="remote_rank0", gpus=1),
    # one process: a CUDA graph whose kernel spins on a flag nobody sets, then synchronize
    Scenario("kernel_never_ends", "kernel_never_ends", "hang", launch="hand", gpus=1),
    Scenario("rendezvous_missing", "rendezvous_missing", "hang", launch="hand_rank0", gpus=1),
    Scenario("teardown_destroy", "teardown_destroy", "hang"),
    Scenario("teardown_graph_attr", "teardown_graph_attr", "hang"),
    Scenario("unbalanced", "unbalanced", "hang"),
    Scenario("healthy_ddp", "healthy_ddp", "control"),
    Scenario("healthy_fsdp", "healthy_fsdp", "control"),
    Scenario("checkpoint", "checkpoint", "control", extra=20),
    Scenario("eval_pause", "eval_pause", "control", seconds=60, extra=20),
    Scenario("slow_loader", "slow_loader", "control", seconds=90),
    Scenario("compile_start", "compile_start", "control", seconds=60, extra=60),
    Scenario("ends_normally", "ends_normally", "control", seconds=20),
]
BY_NAME = {s.name: s for s in SCENARIOS}
ONE_GPU = ("remote_rank_missing", "kernel_never_ends")
SUITES = {
    "hangs": [s.name for s in SCENARIOS if s.kind == "hang"],
    "controls": [s.name for s in SCENARIOS if s.kind == "control"],
    "all": [s.name for s in SCENARIOS],
    # two device calls of at most ~9 minutes on 4 GPUs (see --plan), and the hangs of
    # one process on one GPU (c: any machine; hang_daemon_e2e.py --scenario runs each)
    "a": [*[s.name for s in SCENARIOS if s.kind == "hang" and s.name not in ONE_GPU], "eval_pause"],
    "b": [s.name for s in SCENARIOS if s.kind == "control" and s.name != "eval_pause"],
    "c": list(ONE_GPU),
}


def expand(names: list[str], args: argparse.Namespace) -> list[Scenario]:
    """The named scenarios, longest first (ties in the table's order: the 1-GPU job early)."""
    out: list[Scenario] = []
    for n in names or ["all"]:
        for m in SUITES.get(n, [n]):
            if m not in BY_NAME:
                raise SystemExit(f"unknown scenario {m!r}; known: {', '.join(BY_NAME)}")
            if BY_NAME[m] not in out:
                out.append(BY_NAME[m])
    return sorted(
        out, key=lambda s: -s.estimate(args.hang_seconds, args.control_seconds, args.settle)
    )


def visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices or UUIDs), None when it is not set."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    out: list[str] = []
    for tok in cvd.split(","):
        tok = tok.strip()
        if not tok or tok.startswith("-"):
            break  # CUDA stops at the first invalid entry
        out.append(tok)
    return out


def count_gpus(timeout: float = 20.0) -> tuple[int, str]:
    """(GPUs on this machine, how that was learnt): nvidia-smi -L, else torch, bounded."""
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout)
        if r.returncode == 0:  # MIG lines are indented under their GPU: count GPUs only
            return sum(ln.startswith("GPU ") for ln in r.stdout.splitlines()), "nvidia-smi -L"
    except (OSError, subprocess.TimeoutExpired):
        pass
    code = "import torch; print(torch.cuda.device_count())"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=3 * timeout
        )
        return int(r.stdout.strip().splitlines()[-1]), "torch.cuda.device_count()"
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0, "no nvidia-smi, no torch"


def devices(wanted: int | None, fake: bool) -> tuple[list[str], str]:
    """The devices the harness may hand out (CUDA_VISIBLE_DEVICES values) and their source.

    Never more than exist, unless fake (--plan, --dry-run): there --gpus may exceed them.
    """
    visible = visible_devices()
    if visible is not None:
        # torch counts through the mask already; nvidia-smi ignores it
        found, how = len(visible), "CUDA_VISIBLE_DEVICES"
    else:
        found, how = count_gpus()
        visible = [str(i) for i in range(found)]
    if wanted is None:
        return visible, how
    if wanted > found and not fake:
        return visible, f"{how}; --gpus {wanted} cut to the {found} found"
    visible += [str(i) for i in range(found, wanted)]  # fake GPUs beyond the real ones
    return visible[:wanted], how


def plan(scens: list[Scenario], ngpus: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The schedule the harness follows (start whatever fits, in order), on estimates.

    A scenario wider than the machine is a row with "skipped" and never starts.
    """
    t, free = 0.0, list(range(ngpus))
    running: list[tuple[float, list[int]]] = []
    rows: list[dict[str, Any]] = [
        {"name": s.name, "skipped": too_wide(s, ngpus)} for s in scens if too_wide(s, ngpus)
    ]
    pending = [s for s in scens if not too_wide(s, ngpus)]
    while pending:
        for s in list(pending):
            if len(free) >= s.gpus:
                gpus = sorted(free)[: s.gpus]
                free = [g for g in free if g not in gpus]
                end = t + s.estimate(args.hang_seconds, args.control_seconds, args.settle)
                running.append((end, gpus))
                rows.append({"name": s.name, "gpus": gpus, "start": t, "end": end})
                pending.remove(s)
        if pending:
            t = min(e for e, _ in running)
            free += [g for e, gs in running if e == t for g in gs]
            running = [(e, gs) for e, gs in running if e != t]
    return rows


def too_wide(s: Scenario, ngpus: int) -> str:
    """Why a scenario cannot run on ngpus GPUs ('' when it can)."""
    return f"needs {s.gpus} GPU(s); {ngpus} here" if s.gpus > ngpus else ""


def short_watch(hang_s: float) -> list[str]:
    """A hang watched shorter than the daemon's default decision window cannot be flagged."""
    try:
        from gpuwatchd.health.hangs.detector import HangThresholds

        window = HangThresholds().decide_after_seconds
    except Exception:  # the daemon's code is not importable here
        return []
    if hang_s >= window + 10:
        return []
    return [f"--hang-seconds {hang_s:.0f} < the detector's {window:.0f} s window + a poll"]


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments of tests/gpu/nccl_scenarios.py."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("names", nargs="*", help=f"scenarios or suites ({', '.join(SUITES)})")
    ap.add_argument("--out", default="gpuscen-out")
    ap.add_argument(
        "--gpus",
        type=int,
        help="GPUs to spread the scenarios over (default: those visible; with --dry-run 4)",
    )
    ap.add_argument("--hang-seconds", type=float, default=90.0, help="watch a hang this long")
    ap.add_argument("--control-seconds", type=float, default=180.0, help="main phase of controls")
    ap.add_argument("--settle", type=float, default=10.0, help="training before kill or fault")
    ap.add_argument("--warm", type=float, default=8.0, help="training before `ready`")
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--daemon-url", default="http://127.0.0.1:10370", help="'' = no daemon")
    ap.add_argument(
        "--daemon-poll", type=float, default=2.0, help="seconds between reads of /hangs, /alerts"
    )
    ap.add_argument("--ras-port-base", type=int, default=28100)
    ap.add_argument("--master-port-base", type=int, default=29600)
    ap.add_argument("--scratch", default="/tmp/gpuscen-ckpt", help="checkpoint files (deleted)")
    ap.add_argument(
        "--full-hangs", action="store_true", help="watch each hang --hang-seconds even once flagged"
    )
    ap.add_argument("--plan", action="store_true", help="print the schedule and exit")
    ap.add_argument("--dry-run", action="store_true", help="fake ranks that sleep (no GPU)")
    return ap
