#!/usr/bin/env python3
"""End to end on a real GPU: a real Xid 31 reaches /metrics and /events within a second.

Starts `python -m gpuwatchd run` on 127.0.0.1, waits until its kernel log
reader has caught up with the ring buffer, then runs a CUDA kernel (in a
child process) that stores to an unmapped address. The driver logs Xid 31
(MMU fault) for that process. The script then measures:

- record -> metric: from the kernel record's own timestamp (CLOCK_MONOTONIC,
  read back from /dev/kmsg, corrected by a clock probe written to /dev/kmsg)
  to the first scrape of /metrics that shows the new Xid 31 on the right GPU;
- launch -> metric: from the kernel launch to the same scrape;
- that `gpuwatchd_xid_*` carries the GPU's UUID as NVIDIA reports it;
- that /events holds the report with the faulting pid, process name and an
  attribution other than "process gone" (the child stays alive meanwhile);
- that the event was stored once (the NVML Xid event, if the daemon also
  listens to NVML, is merged into the log report).

Needs root (/dev/kmsg), an NVIDIA GPU with its driver, and either CuPy
(RawKernel) or nothing at all (the fallback hands PTX to the driver API
through ctypes; the driver JIT-compiles it, no CUDA toolkit needed).
Run from the repository root:

    sudo python3 tests/gpu/xid31_e2e.py [--via auto|cupy|ptx] [--out result.json]

Prints one JSON object; exit status 0 when everything held and the
record -> metric latency was under --max-latency (default 1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import UNMAPPED, illegal_write_ptx  # noqa: E402

CUPY_SOURCE = r"""
extern "C" __global__ void scribble(unsigned int* where) { *where = 31u; }
"""


# --- the faulting child -------------------------------------------------------------------


def fault_ptx() -> dict[str, Any]:
    r = illegal_write_ptx()
    return {
        "via": "ptx",
        "bus": r["bus"],
        "launch_rc": r["launch"],
        "sync_rc": r["synchronize"],
        "launched_mono": r["launched_mono"],
        "illegal_address": r["synchronize"] == 700,
    }


def fault_cupy() -> dict[str, Any]:
    import cupy

    kernel = cupy.RawKernel(CUPY_SOURCE, "scribble")
    kernel.compile()  # compile before the clock starts
    bus = cupy.cuda.runtime.deviceGetPCIBusId(0)
    launched = time.monotonic()
    kernel((1,), (1,), (cupy.uint64(UNMAPPED),))
    error = ""
    try:
        cupy.cuda.Device(0).synchronize()
    except Exception as exc:  # cudaErrorIllegalAddress is what we want
        error = f"{type(exc).__name__}: {exc}"
    return {
        "via": "cupy",
        "bus": bus,
        "error": error,
        "launched_mono": launched,
        "illegal_address": "illegal" in error.lower(),
    }


def fault_simulated(bus: str) -> dict[str, Any]:
    """No GPU: write the line the driver would, to /dev/kmsg (facility user, needs root)."""
    line = (
        f"NVRM: Xid (PCI:{bus[:-2]}): 31, pid={os.getpid()}, name={_comm()}, channel"
        " 0x0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_6 faulted @"
        " 0x7f_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE"
    )
    launched = time.monotonic()
    with open("/dev/kmsg", "w") as f:
        f.write(line + "\n")
    return {"via": "simulated", "bus": bus, "launched_mono": launched, "illegal_address": True}


def _comm() -> str:
    with open(f"/proc/{os.getpid()}/comm") as f:
        return f.read().strip()


def child(via: str, bus: str = "") -> int:
    """Runs in the child: fault, report, then stay alive so the pid can be attributed."""
    if via == "simulate":
        print(json.dumps({**fault_simulated(bus), "pid": os.getpid()}), flush=True)
        time.sleep(30)
        return 0
    if via == "auto":
        try:
            import cupy  # noqa: F401

            via = "cupy"
        except Exception:
            via = "ptx"
    try:
        result = fault_cupy() if via == "cupy" else fault_ptx()
    except Exception as exc:
        result = {"via": via, "error": f"{type(exc).__name__}: {exc}", "illegal_address": False}
    result["pid"] = os.getpid()
    print(json.dumps(result), flush=True)
    # keep the process (and its cgroup) for the daemon to attribute; the parent kills us
    time.sleep(30)
    return 0


# --- helpers of the parent --------------------------------------------------------------


def normalize_bus(bus: str) -> str:
    text = bus.strip().lower()
    domain, _, rest = text.partition(":")
    try:
        text = f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        pass
    return text if "." in text else text + ".0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def xid31_count(text: str, bus: str) -> float:
    return sum(
        v
        for lab, v in samples(text, "gpuwatchd_xid_errors_total")
        if lab.get("xid") == "31" and lab.get("pci_bus_id") == bus
    )


def nvidia_uuid(bus: str) -> str:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=pci.bus_id,uuid,name,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and normalize_bus(parts[0]) == bus:
            return parts[1]
    return ""


class KmsgWatch:
    """Our own /dev/kmsg reader: the kernel timestamp of the Xid 31 of a given pid."""

    def __init__(self) -> None:
        self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)  # only what happens from now on
        self.records: list[tuple[int, float, str]] = []  # (seq, kernel seconds, message)
        self.seen_mono: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not self._stop.is_set():
            poller.poll(100)
            while True:
                try:
                    data = os.read(self.fd, 16384)
                except BlockingIOError:
                    break
                except BrokenPipeError:
                    continue
                head, _, msg = data.decode(errors="replace").partition(";")
                fields = head.split(",")
                seq, usec = int(fields[1]), int(fields[2])
                self.records.append((seq, usec / 1e6, msg.split("\n", 1)[0]))
                self.seen_mono[seq] = time.monotonic()

    def clock_skew(self) -> float:
        """kernel record time minus CLOCK_MONOTONIC, from a probe written to /dev/kmsg."""
        tag = f"gpuwatchd-e2e clock probe {os.getpid()} {time.time_ns()}"
        with open("/dev/kmsg", "w") as f:
            before = time.monotonic()
            f.write(tag + "\n")
            f.flush()
            after = time.monotonic()
        for _ in range(100):
            for _seq, ksec, msg in self.records:
                if msg == tag:
                    return ksec - (before + after) / 2
            time.sleep(0.01)
        return 0.0

    def xid31(self, pid: int, timeout: float) -> tuple[int, float, str] | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for rec in self.records:
                if "Xid" in rec[2] and ": 31," in rec[2] and f"pid={pid}," in rec[2]:
                    return rec
            time.sleep(0.005)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)
        os.close(self.fd)


# --- the run --------------------------------------------------------------------------


def run(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    result.update(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        host=socket.gethostname(),
        kernel=os.uname().release,
        via=args.via,
    )
    state = tempfile.mkdtemp(prefix="gpuwatchd-e2e-")
    cfg = Path(state) / "config.yaml"
    # burst_window 1 s: an earlier Xid 31 (another test) does not swallow this one's row
    drill = ", accept_userspace: true" if args.via == "simulate" else ""
    cfg.write_text(f"sources:\n  kmsg: {{backend: kmsg{drill}}}\nxid: {{burst_window: 1}}\n")
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(state) / "daemon.log", "w+")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "run",
            "--config",
            str(cfg),
            "--listen",
            f"127.0.0.1:{port}",
            "--state-dir",
            state,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    watch = KmsgWatch()
    fault: subprocess.Popen[str] | None = None
    try:
        # 1. the daemon serves and its kernel log reader has read the whole ring buffer
        ready_by = time.monotonic() + 90
        last_read, stable_since = -1.0, time.monotonic()
        while True:
            if daemon.poll() is not None:
                raise RuntimeError("daemon exited early")
            status, text = get(url + "/metrics")
            up = samples(text, "gpuwatchd_kmsg_reader_up") if status == 200 else []
            read = sum(v for _, v in samples(text, "gpuwatchd_kmsg_records_read_total"))
            if read != last_read:
                last_read, stable_since = read, time.monotonic()
            if up and up[0][1] == 1 and time.monotonic() - stable_since > 1.0:
                break
            if time.monotonic() > ready_by:
                raise RuntimeError(f"daemon not ready: /metrics {status}, reader_up {up}")
            time.sleep(0.1)
        result["records_read_before"] = last_read
        skew = watch.clock_skew()
        result["kernel_clock_minus_monotonic_ms"] = round(skew * 1000, 3)

        # 2. the fault, in a child that stays alive (counts taken before it, per bus)
        before = get(url + "/metrics")[1]
        fault = subprocess.Popen(
            [sys.executable, __file__, "--fault", "--via", args.via, "--bus", args.bus],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert fault.stdout is not None
        line = fault.stdout.readline()
        cuda = json.loads(line) if line.strip() else {"error": "child printed nothing"}
        result["cuda"] = cuda
        if not cuda.get("illegal_address"):
            raise RuntimeError(f"the kernel did not fault as planned: {cuda}")
        bus = normalize_bus(cuda["bus"])
        result["gpu_bus_id"] = bus

        # 3. scrape until the Xid 31 shows up on that GPU
        baseline = xid31_count(before, bus)
        deadline = time.monotonic() + args.timeout
        detected_mono = None
        metrics = ""
        while time.monotonic() < deadline:
            status, metrics = get(url + "/metrics")
            if status == 200 and xid31_count(metrics, bus) > baseline:
                detected_mono = time.monotonic()
                break
            time.sleep(0.01)
        record = watch.xid31(cuda["pid"], timeout=2.0)
        result["kernel_record"] = (
            {"sequence": record[0], "kernel_seconds": record[1], "message": record[2]}
            if record
            else None
        )
        if detected_mono is None:
            raise RuntimeError(
                f"no Xid 31 on {bus} in /metrics within {args.timeout}s"
                f" (kernel record seen: {record is not None})"
            )
        launch_ms = (detected_mono - cuda["launched_mono"]) * 1000
        result["launch_to_metric_ms"] = round(launch_ms, 1)
        if record is not None:
            record_mono = record[1] - skew
            result["record_to_metric_ms"] = round((detected_mono - record_mono) * 1000, 1)
            result["launch_to_record_ms"] = round((record_mono - cuda["launched_mono"]) * 1000, 1)
            seen = watch.seen_mono.get(record[0])
            if seen is not None:
                result["record_to_script_reader_ms"] = round((seen - record_mono) * 1000, 1)
        result["metric_lines"] = [
            f"{name}{{{','.join(f'{k}={v!r}' for k, v in sorted(lab.items()))}}} {val}"
            for name in ("gpuwatchd_xid_active", "gpuwatchd_xid_errors_total")
            for lab, val in samples(metrics, name)
            if lab.get("xid") == "31" and lab.get("pci_bus_id") == bus
        ]

        # 4. the right GPU: the UUID on the metric is NVIDIA's for that bus id
        uuid = nvidia_uuid(bus)
        labels = [
            lab
            for lab, _ in samples(metrics, "gpuwatchd_xid_errors_total")
            if lab.get("xid") == "31" and lab.get("pci_bus_id") == bus
        ]
        result["nvidia_smi_uuid"] = uuid
        result["metric_uuid"] = labels[0].get("uuid", "") if labels else ""
        result["metric_gpu"] = labels[0].get("gpu", "") if labels else ""
        result["uuid_matches"] = bool(uuid) and result["metric_uuid"] == uuid

        # 5. /events holds it, attributed, once
        event = None
        for _ in range(100):
            status, body = get(url + f"/events?code=31&gpu={bus}&limit=50")
            rows = json.loads(body).get("events", []) if status == 200 else []
            mine = [r for r in rows if r.get("pid") == cuda["pid"]]
            if mine:
                event = mine[0]
                result["events_rows_for_this_fault"] = len(mine)
                break
            time.sleep(0.05)
        result["event"] = event
        attribution = (event or {}).get("attribution", {})
        result["attributed"] = bool(event) and attribution.get("attribution") not in (
            None,
            "process gone",
            "report too old to attribute (the pid may be reused)",
        )
        merged = samples(get(url + "/metrics")[1], "gpuwatchd_xid_nvml_merged_total")
        result["nvml_merged_total"] = merged[0][1] if merged else None
        latency = result.get("record_to_metric_ms")
        result["ok"] = bool(
            event
            and (result["uuid_matches"] or args.via == "simulate")  # no NVML in a drill
            and result["attributed"]
            and result.get("events_rows_for_this_fault") == 1
            and event.get("process")
            and latency is not None
            and latency < args.max_latency * 1000
        )
        return result
    finally:
        if fault is not None and fault.poll() is None:
            fault.kill()
            fault.wait(10)
        watch.close()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
        result["daemon_exit"] = daemon.returncode
        log.seek(0)
        result["daemon_log_tail"] = log.read()[-3000:]
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--via",
        choices=("auto", "cupy", "ptx", "simulate"),
        default="auto",
        help="how to fault (auto: CuPy if importable, else PTX through ctypes; simulate:"
        " no GPU, write the driver's line to /dev/kmsg from user space, a pipeline drill)",
    )
    ap.add_argument("--bus", default="0000:00:06.0", help="GPU bus id for --via simulate")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the metric")
    ap.add_argument("--max-latency", type=float, default=1.0, help="seconds, record to metric")
    ap.add_argument("--out", help="also write the JSON result here")
    ap.add_argument("--fault", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fault:
        return child(args.via, args.bus)
    if os.geteuid() != 0:
        print("needs root: reads and writes /dev/kmsg", file=sys.stderr)
        return 2
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
