"""What tests/gpu/nccl_scenarios.py records while a scenario runs, every wait bounded.

- proc_sample: /proc/PID/stat (state, utime, stime, starttime, threads) and /proc/PID/io;
- ras_raw: one NCCL RAS answer exactly as received (its own small client, so an answer
  the project's parser rejects is still kept), plus what the project's parser made of it;
- trigger_flight_recorder: a write to each rank's TORCH_NCCL_DEBUG_INFO_PIPE_FILE pipe;
- pyspy: one `py-spy dump` per pid, in parallel, with a deadline;
- DaemonPoller: /hangs and /alerts of a running gpuwatchd every 2 s (kept when they change),
  the hang/job lines of /metrics every 10 s and all of it every 30 s;
- KmsgReader: NVRM lines of /dev/kmsg from the harness start on;
- NvmlSampler: utilisation, power and GPM per GPU once a second (tests/gpu/hang_watch.py).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_sample(pid: int) -> dict[str, Any]:
    """State and CPU seconds of one process, its I/O counters; {"alive": False} once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return {"alive": False}
    fields = raw[raw.rindex(")") + 2 :].split()
    out: dict[str, Any] = {
        "alive": fields[0] not in ("Z", "X"),
        "state": fields[0],
        "utime_s": int(fields[11]) / CLK_TCK,
        "stime_s": int(fields[12]) / CLK_TCK,
        "threads": int(fields[17]),
        "starttime": int(fields[19]),
    }
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar", "read_bytes", "write_bytes", "syscr", "syscw"):
                    out[key] = int(value)
    except OSError as e:
        out["io_error"] = e.strerror
    return out


def task_cpu_seconds(pid: int) -> float | None:
    """utime+stime summed over /proc/PID/task/*/stat, as the daemon's job view reads it."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    ticks = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue  # a thread that ended between listdir and open
        fields = raw[raw.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def ras_raw(
    addr: str, fmt: str = "json", verbose: bool = False, timeout: float = 8.0
) -> dict[str, Any]:
    """One RAS query: CLIENT PROTOCOL 2, TIMEOUT 5, SET FORMAT, [VERBOSE] STATUS."""
    host, _, port = addr.rpartition(":")
    start = time.monotonic()
    out: dict[str, Any] = {"addr": addr, "format": fmt, "t": time.time(), "text": ""}
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            f = s.makefile("rwb")

            def say(line: str) -> str:
                f.write(line.encode() + b"\n")
                f.flush()
                return f.readline().decode(errors="replace").strip()

            out["hello"] = say("CLIENT PROTOCOL 2")
            out["timeout_answer"] = say("TIMEOUT 5")
            if fmt != "text":
                out["format_answer"] = say(f"SET FORMAT {fmt}")
            f.write((("VERBOSE " if verbose else "") + "STATUS\n").encode())
            f.flush()
            chunks = []
            deadline = start + timeout
            while time.monotonic() < deadline:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    data = f.read1(65536)
                except TimeoutError:
                    out["partial"] = True  # keep what came
                    break
                if not data:
                    break
                chunks.append(data)
            out["text"] = b"".join(chunks).decode(errors="replace")
    except (OSError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = round(time.monotonic() - start, 4)
    if fmt == "json" and out["text"]:
        out["parsed"] = _parse_with_project(out["text"])
    return out


def _parse_with_project(text: str) -> dict[str, Any]:
    """What gpuwatchd's own RAS parser reads from the answer (counts per rank), or its error."""
    try:
        from gpuwatchd.sources.hangs import ras

        rep = ras.parse_report(text)
    except Exception as e:  # the malformed answers of NCCL 2.28.9 are what we want to see
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "communicators": [
            {
                "hash": c.hash,
                "ranks": [
                    {"rank": r.rank, "pid": r.pid, "counts": dict(r.collective_counts)}
                    for r in c.ranks
                ],
            }
            for c in rep.communicators
        ]
    }


def trigger_flight_recorder(pipe_prefix: str) -> list[dict[str, Any]]:
    """Write to every rank's pipe (never blocks: a pipe nobody reads is reported, not waited on)."""
    out = []
    for path in sorted(glob.glob(pipe_prefix + "*.pipe")):
        rec: dict[str, Any] = {"pipe": os.path.basename(path), "t": time.time()}
        try:
            if not stat.S_ISFIFO(os.stat(path).st_mode):
                rec["error"] = "not a FIFO"
            else:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.write(fd, b"1\n")
                finally:
                    os.close(fd)
                rec["ok"] = True
        except OSError as e:
            rec["error"] = errno.errorcode.get(e.errno or 0, str(e))
        out.append(rec)
    return out


def pyspy(pids: list[int], out_dir: str, tag: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """`py-spy dump --native` of each pid at once; the text goes to OUT_DIR/pyspy-TAG-PID.txt."""
    exe = shutil.which("py-spy")
    if not exe or not pids:
        return [{"error": "py-spy not on PATH" if not exe else "no pid"}]

    def one(pid: int) -> dict[str, Any]:
        start = time.monotonic()
        rec: dict[str, Any] = {"pid": pid, "t": time.time(), "tag": tag}
        try:
            r = subprocess.run(
                [exe, "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            text, rec["rc"] = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired:
            text, rec["rc"] = "timeout", None
        rec["seconds"] = round(time.monotonic() - start, 3)
        path = os.path.join(out_dir, f"pyspy-{tag}-{pid}.txt")
        with open(path, "w") as f:
            f.write(text)
        rec["file"] = os.path.basename(path)
        rec["lines"] = text.count("\n")
        return rec

    with ThreadPoolExecutor(len(pids)) as ex:
        return list(ex.map(one, pids))


def _get(url: str, timeout: float = 3.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


METRIC_PREFIXES = (
    "gpuwatchd_job",
    "gpuwatchd_hang",
    "gpuwatchd_alerts_firing",
    "gpuwatchd_gpu_utilization",
    "gpuwatchd_gpm",
    "gpuwatchd_source_",
)


class DaemonPoller(threading.Thread):
    """Polls a running gpuwatchd; writes changed snapshots as JSON lines under out_dir."""

    def __init__(self, url: str, out_dir: str, interval: float = 2.0) -> None:
        super().__init__(name="daemon-poller", daemon=True)
        self.url = url.rstrip("/")
        self.interval = interval
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.hangs: list[tuple[float, list[dict[str, Any]]]] = []  # every poll, light docs
        self.alerts: list[tuple[float, list[dict[str, Any]]]] = []
        self.errors = 0
        self.polls = 0
        self._files = {
            k: open(os.path.join(out_dir, f"daemon-{k}.jsonl"), "a")
            for k in ("hangs", "alerts", "metrics", "metrics-full")
        }
        self._last: dict[str, str] = {}
        self._last_full = 0.0

    def _keep(self, kind: str, t: float, body: Any) -> None:
        text = json.dumps(body, sort_keys=True)
        digest = hashlib.sha1(text.encode()).hexdigest()
        if self._last.get(kind) != digest:
            self._last[kind] = digest
            self._files[kind].write(json.dumps({"t": t, kind: body}) + "\n")
            self._files[kind].flush()

    def _fetch(self, path: str, t: float) -> Any:
        """One endpoint's JSON; None (and the error kept) when it does not answer."""
        try:
            return json.loads(_get(self.url + path))
        except (OSError, ValueError) as e:
            self.errors += 1
            self._keep(path.strip("/"), t, {"error": f"{type(e).__name__}: {e}"})
            return None

    def poll_once(self) -> None:
        t = time.time()
        self.polls += 1
        hangs_doc, alerts_doc = self._fetch("/hangs", t), self._fetch("/alerts", t)
        hangs = hangs_doc.get("hangs", []) if isinstance(hangs_doc, dict) else []
        alerts = alerts_doc.get("alerts", []) if isinstance(alerts_doc, dict) else []
        light = [{k: v for k, v in h.items() if k not in ("stacks", "ras")} for h in hangs]
        with self.lock:
            self.hangs.append((t, light))
            self.alerts.append((t, alerts))
        if hangs_doc is not None:
            self._keep("hangs", t, hangs)
        if alerts_doc is not None:
            self._keep("alerts", t, alerts)
        if self.polls % 5 != 1:  # /metrics every 5th poll: scrapes cost the daemon CPU
            return
        try:
            metrics = _get(self.url + "/metrics").decode(errors="replace")
        except OSError as e:
            self.errors += 1
            self._keep("metrics", t, {"error": f"{type(e).__name__}: {e}"})
            return
        lines = [ln for ln in metrics.splitlines() if ln.startswith(METRIC_PREFIXES)]
        self._files["metrics"].write(json.dumps({"t": t, "lines": lines}) + "\n")
        if t - self._last_full >= 30.0:
            self._last_full = t
            self._files["metrics-full"].write(json.dumps({"t": t, "text": metrics}) + "\n")

    def run(self) -> None:
        while not self.stop_event.is_set():
            start = time.monotonic()
            self.poll_once()
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - start)))

    def stop(self) -> None:
        self.stop_event.set()
        if self.is_alive():
            self.join(10)
        for f in self._files.values():
            f.close()

    def detection(self, match: Any, since: float, until: float) -> dict[str, Any]:
        """The first /hangs record and JobHangSuspected alert that match(doc) in [since, until]."""
        out: dict[str, Any] = {"flagged": False, "alert": False}
        with self.lock:
            hangs, alerts = list(self.hangs), list(self.alerts)
        job = ""
        for t, docs in hangs:
            if t < since or t > until:
                continue
            for d in docs:
                if match(d):
                    if not out["flagged"]:
                        out.update(flagged=True, first_seen=t, job=d.get("job", ""), first=d)
                    out["last"] = d  # signature and facts fill in after forensics
                    job = str(d.get("job", ""))
        severities: list[str] = []
        for t, items in alerts:
            if t < since or t > until:
                continue
            for a in items:
                labels = a.get("labels", {})
                if labels.get("alertname") != "JobHangSuspected":
                    continue
                if job and job in labels.values() or match({"labels": labels}):
                    if not out["alert"]:
                        out.update(alert=True, alert_first_seen=t, alert_labels=labels)
                        out["alert_status"] = a.get("status")
                    sev = str(labels.get("severity", ""))
                    if sev not in severities:
                        severities.append(sev)  # warning then critical: a straggler escalated
        out["alert_severities"] = severities
        return out


class KmsgReader(threading.Thread):
    """NVRM lines of the kernel log written after the harness started (root only)."""

    def __init__(self) -> None:
        super().__init__(name="kmsg", daemon=True)
        self.lines: list[tuple[float, str]] = []
        self.error = ""
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(fd, 0, os.SEEK_END)
        except OSError as e:
            self.error = str(e)
            return
        try:
            while not self.stop_event.is_set():
                try:
                    rec = os.read(fd, 8192).decode(errors="replace")
                except BlockingIOError:
                    self.stop_event.wait(0.5)
                    continue
                except OSError as e:
                    if e.errno == errno.EPIPE:  # records overwritten before we read them
                        continue
                    self.error = str(e)
                    return
                if "NVRM" in rec or "Xid" in rec:
                    self.lines.append((time.time(), rec.strip()))
        finally:
            os.close(fd)

    def between(self, since: float, until: float) -> list[dict[str, Any]]:
        return [{"t": t, "line": ln} for t, ln in self.lines if since <= t <= until]


class NvmlSampler(threading.Thread):
    """Per GPU utilisation, power, GPM once a second into OUT/nvml.jsonl (when pynvml works)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(name="nvml", daemon=True)
        self.path = os.path.join(out_dir, "nvml.jsonl")
        self.stop_event = threading.Event()
        self.error = ""
        self.rows: list[dict[str, Any]] = []  # also in memory: each trace keeps its window

    def run(self) -> None:
        try:
            from hang_watch import Gpus  # tests/gpu is on sys.path

            gpus = Gpus()
        except Exception as e:  # no GPU (dry run) or no pynvml
            self.error = f"{type(e).__name__}: {e}"
            return
        with open(self.path, "a") as f:
            while not self.stop_event.is_set():
                start = time.monotonic()
                try:
                    _, pids, raw = gpus.read()
                    row = {"t": time.time(), "gpus": raw, "pids": pids}
                    self.rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                except Exception as e:
                    self.error = f"{type(e).__name__}: {e}"
                self.stop_event.wait(max(0.0, 1.0 - (time.monotonic() - start)))


def summary_row(t: dict[str, Any]) -> dict[str, Any]:
    """One line of summary.json from a scenario's trace."""
    det = t.get("daemon", {})
    first, last = det.get("first", {}), det.get("last", {})
    t0 = t["t_launch"]

    def rel(k: str) -> float | None:
        return round(t[k] - t0, 1) if t.get(k) else None

    row: dict[str, Any] = {
        "scenario": t["scenario"]["name"],
        "kind": t["scenario"]["kind"],
        "gpus": t["gpus"],
        "job_key": t.get("job_key", ""),
        "ready_s": rel("t_ready"),
        "hang_start_s": rel("hang_start"),
        "hang_what": t.get("hang_what", []),
        "flagged": det.get("flagged", False),
        "detected_after_s": det.get("after_s"),
        "alert_after_s": det.get("alert_after_s"),
        "severity": (det.get("alert_labels") or {}).get("severity", ""),
        "severities": det.get("alert_severities", []),
        "conditions": first.get("conditions", []),
        "signals": first.get("signals", ""),
        "reason": first.get("reason", ""),
        "signature": last.get("signature", ""),
        "missing": last.get("missing", []),
        "where": last.get("where", ""),
        "ras_answers": len(t["ras"]),
        "ras_errors": sum(1 for r in t["ras"] if r.get("error")),
        # answers gpuwatchd's parser rejects (NCCL 2.28.9 writes a comma short for missing ranks)
        "ras_parse_errors": sum(1 for r in t["ras"] if "error" in (r.get("parsed") or {})),
        "fr_files": len(t.get("fr_files", {})),
        "pyspy_ok": sum(1 for r in t["pyspy"] if r.get("rc") == 0),
        "kmsg_lines": len(t.get("kmsg", [])),
        "returned": sorted((t.get("markers", {}).get("returned") or {}).keys()),
        "faulted": (t.get("markers", {}).get("faulted") or {}),
        "phases": sorted(
            {m.get("phase", "") for m in (t.get("markers", {}).get("phase") or {}).values()}
        ),
        "exit_codes": t.get("exit_codes", {}),
        "seconds": round(t["t_end"] - t0, 1),
        "notes": t["notes"],
    }
    return row


def nvml_window(
    rows: list[dict[str, Any]], gpus: list[str], since: float, until: float
) -> list[dict[str, Any]]:
    """The NVML samples of [since, until] for these GPUs (all of them when named by UUID)."""
    keep = set(gpus) if all(g.isdigit() for g in gpus) else None
    out = []
    for row in list(rows):
        if since <= row["t"] <= until:
            per_gpu = [g for g in row["gpus"] if keep is None or str(g.get("gpu")) in keep]
            pids = {k: v for k, v in row["pids"].items() if keep is None or k in keep}
            out.append({"t": row["t"], "gpus": per_gpu, "pids": pids})
    return out
