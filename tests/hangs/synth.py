"""The two synthesized hang recordings of tests/fixtures/hangs, rebuilt from real ones.

    python -m tests.hangs.synth [DEST_ROOT]     (default: tests/fixtures/hangs)

No real recording exists yet of a rank whose peers belong to another node, nor of a
single process whose kernel never completes; until one is recorded on a GPU
(tests/gpu/hang_daemon_e2e.py --scenario ...), these stand in, built only from
recorded shapes (each PROVENANCE.md says which):

- remote-rank-missing-synth: rendezvous-missing-4xh200 (rank 0 of WORLD_SIZE=2 alone
  in init_process_group on a 4x H200) with LOCAL_WORLD_SIZE=1 in its environment: the
  process does the same on the node whether its peer was meant to start here or on
  another node; only what the launcher told it differs.
- kernel-never-ends-synth: the peer-death survivor of peerdeath-polls.jsonl (1x H100):
  its GPU ran one spinning thread block (utilisation 100 %, SM activity 0.76 %,
  occupancy 0.01 %, 121-125 W) while its host thread burned a core in
  cudaDeviceSynchronize (pyspy-peerdeath.txt), which is what a kernel that never ends
  looks like from the node; the dead peer is left out, so it is one process alone.

tests/hangs/test_synth_fixtures.py rebuilds both and compares them with the committed files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from tests.hangs.replay import FIXTURES, fixture

REMOTE = "remote-rank-missing-synth"
KERNEL = "kernel-never-ends-synth"
KERNEL_PID = 1031
KERNEL_T0 = 1_795_465_065.0  # the wall time given to the survivor's kernel never completing
KERNEL_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29655",
}
STARTTIME_TICKS = 15_000  # the process's start, in clock ticks since boot (100 a second)


def _dump(doc: Any) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def remote(dest_root: str) -> str:
    src = os.path.join(FIXTURES, "rendezvous-missing-4xh200")
    dest = os.path.join(dest_root, REMOTE)
    os.makedirs(dest, exist_ok=True)
    for name in ("nvml.jsonl", "pyspy-1-1448.txt", "pyspy-2-1448.txt", "rank0.log"):
        shutil.copyfile(os.path.join(src, name), os.path.join(dest, name))
    with open(os.path.join(src, "trace.json")) as f:
        doc = json.load(f)
    doc["environ"]["0"]["LOCAL_WORLD_SIZE"] = "1"
    doc["scenario"] = {**doc["scenario"], "name": "remote_rank_missing"}
    doc["hang_what"] = ["init_process_group, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1, rank 1 never starts"]
    doc["daemon"] = {}  # the live daemon of that run judged the local scenario
    doc["notes"] = ["synthesized by tests/hangs/synth.py from rendezvous-missing-4xh200"]
    with open(os.path.join(dest, "trace.json"), "w") as f:
        f.write(_dump(doc))
    return dest


def _kernel_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in fixture("peerdeath-polls.jsonl").splitlines()]


def kernel(dest_root: str) -> str:
    dest = os.path.join(dest_root, KERNEL)
    os.makedirs(dest, exist_ok=True)
    samples, nvml = [], []
    for row in _kernel_rows():
        t = round(KERNEL_T0 + row["t"], 3)
        cpu = next(
            (r["cpu_seconds"] for j in row["jobs"] for r in j["ranks"] if r["pid"] == KERNEL_PID),
            None,
        )
        gpus = []
        for g in row["gpus"]:
            procs = {p: m for p, m in g["processes"].items() if int(p) == KERNEL_PID}
            gpus.append({**{k: v for k, v in g.items() if k != "processes"}, "processes": procs})
        nvml.append({"t": t, "gpus": gpus})
        rank = {
            "pid": KERNEL_PID,
            "alive": True,
            "state": "R",  # the host thread spins in the synchronize
            "utime_s": cpu if cpu is not None else 1.9,
            "stime_s": 0.0,
            "threads": 4,
            "starttime": STARTTIME_TICKS,
            "rchar": 20_860_609,
            "wchar": 631,
            "syscr": 2728,
            "syscw": 55,
            "read_bytes": 0,
            "write_bytes": 0,
        }
        samples.append({"t": t, "ranks": {"0": rank}})
    dump = fixture("pyspy-peerdeath.txt")
    pyspy = []
    for i, after in ((1, 25.0), (2, 30.0)):
        name = f"pyspy-{i}-{KERNEL_PID}.txt"
        with open(os.path.join(dest, name), "w") as f:
            f.write(dump)
        pyspy.append(
            {"pid": KERNEL_PID, "t": KERNEL_T0 + after, "tag": str(i), "rc": 0, "file": name}
        )
    launch = samples[0]["t"] - 1.0
    doc = {
        "scenario": {
            "name": "kernel_never_ends",
            "mode": "kernel_never_ends",
            "kind": "hang",
            "launch": "hand",
            "gpus": 1,
            "action": "",
            "seconds": 0.0,
            "extra": 0.0,
        },
        "gpus": [0],
        "devices": ["0"],
        "t_launch": launch,
        "t_ready": samples[0]["t"],
        "hang_start": KERNEL_T0,
        "window_start": None,
        "hang_what": ["one thread block spins forever; the host waits in cudaDeviceSynchronize"],
        "ranks": {"0": KERNEL_PID},
        "job_key": "torch:127.0.0.1:29655",
        "environ": {"0": KERNEL_ENV},
        "commands": ["python3 tests/gpu/hang_jobs.py peer 0 RUNDIR"],
        "samples": samples,
        "ras": [],
        "pyspy": pyspy,
        "fr_triggers": [],
        "fr_files": {},
        "markers": {},
        "exit_codes": {},
        "t_end": samples[-1]["t"],
        "kmsg": [],
        "nvml_error": "",
        "daemon": {},
        "notes": ["synthesized by tests/hangs/synth.py from peerdeath-polls.jsonl (rank 0 only)"],
    }
    with open(os.path.join(dest, "trace.json"), "w") as f:
        f.write(_dump(doc))
    with open(os.path.join(dest, "nvml.jsonl"), "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in nvml)
    return dest


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = args[0] if args else FIXTURES
    for built in (remote(root), kernel(root)):
        print(built)
    return 0


if __name__ == "__main__":
    sys.exit(main())
