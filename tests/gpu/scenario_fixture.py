#!/usr/bin/env python3
"""Turn one scenario directory of tests/gpu/nccl_scenarios.py into a replay fixture.

    python3 tests/gpu/scenario_fixture.py SRC_SCENARIO_DIR DEST_FIXTURE_DIR
        [--expect-from-summary] [--check]

Copies what tests/hangs/real_trace.py replays: trace.json (the fields the replay and a
reader need, the machine's paths replaced by RUNDIR/..., the NVML window moved out),
nvml.jsonl, the py-spy dumps, each rank's flight recorder dump (fr-dump-rankN.pkl.gz)
and the logs cut to their head and tail; writes PROVENANCE.md (to finish by hand) and
an expect.json drafted from the scenario's kind (or, --expect-from-summary, from what
the daemon beside the harness reported). Past SIZE_TARGET the JSON files are gzipped.
--check replays the result through the hang monitor and prints what expect.json misses.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pickle
import re
import shlex
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = "tests/gpu/nccl_jobs.py"
SIZE_TARGET = 300_000
LOG_HEAD, LOG_TAIL, LOG_MAX = 60, 140, 24_000
# what the replay reads of trace.json, and the small fields kept for a reader
KEEP = (
    "scenario",
    "gpus",
    "devices",
    "t_launch",
    "t_ready",
    "hang_start",
    "window_start",
    "hang_what",
    "go_at",
    "ranks",
    "job_key",
    "environ",
    "commands",
    "samples",
    "ras",
    "pyspy",
    "fr_triggers",
    "fr_files",
    "markers",
    "exit_codes",
    "t_end",
    "kmsg",
    "nvml_error",
    "daemon",
    "notes",
)
SAMPLE_DROP = ("launchers",)
RAS_KEEP = ("addr", "format", "t", "text", "error", "partial", "seconds")
DEAD_OR_MISSING = ("kill1",)
EARLY = {"remote_rank_missing": "rank_missing", "kernel_never_ends": "kernel_stuck"}


class Scrub:
    """The recording machine's absolute paths out of every string."""

    def __init__(self, trace: dict[str, Any]) -> None:
        self.pairs: list[tuple[str, str]] = []
        words = [w for c in trace.get("commands") or [] for w in shlex.split(c)]
        for i, w in enumerate(words):
            if w.endswith(JOBS) and len(w) > len(JOBS):
                self.pairs.append((w[: -len(JOBS)], ""))  # the checkout: relative paths
            if w == "--dir" and i + 1 < len(words):
                rundir = os.path.dirname(os.path.dirname(words[i + 1].rstrip("/")))
                if rundir not in ("", "/"):
                    self.pairs.append((rundir, "RUNDIR"))
            if w == "--scratch" and i + 1 < len(words):
                self.pairs.append((words[i + 1], "RUNDIR/scratch"))
        self.pairs = sorted(set(self.pairs), key=lambda p: -len(p[0]))

    def text(self, s: str) -> str:
        for old, new in self.pairs:
            s = s.replace(old, new)
        s = re.sub(r"/[^\s\"'():,]*/site-packages/", "site-packages/", s)
        return re.sub(r"/[^\s\"'():,]*/bin/python3?[0-9.]*", "python3", s)

    def value(self, v: Any) -> Any:
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return type(v)(self.value(x) for x in v)
        return v


def leftover_paths(text: str) -> list[str]:
    """Absolute paths under the usual private roots that are still there."""
    return sorted(set(re.findall(r"(?:/home|/tmp|/work|/root|/scratch|/mnt)/[^\s\"']+", text)))


def _round(v: Any) -> Any:
    if isinstance(v, float) and v and math.isfinite(v):
        return float(f"{v:.5g}")
    return v


def nvml_rows(trace: dict[str, Any], src: str) -> list[dict[str, Any]]:
    """The scenario's NVML window: trace.json's `nvml`, else the harness's nvml.jsonl cut."""
    rows = trace.get("nvml") or []
    if not rows:
        path = next(
            (p for p in (os.path.join(src, "nvml.jsonl"), os.path.join(src, "..", "nvml.jsonl"))),
            "",
        )
        keep = {str(d) for d in trace.get("devices") or trace.get("gpus") or []}
        t0, t1 = trace.get("t_launch", 0.0), trace.get("t_end", math.inf)
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    row = json.loads(line)
                    if t0 <= row["t"] <= t1:
                        gpus = [g for g in row["gpus"] if not keep or str(g["gpu"]) in keep]
                        rows.append({"t": row["t"], "gpus": gpus})
    out = []
    for row in rows:  # the per-GPU pid lists repeat `processes`: dropped
        gpus = [{k: _round(v) for k, v in g.items()} for g in row["gpus"]]
        out.append({"t": round(row["t"], 3), "gpus": gpus})
    return out


def slim_trace(trace: dict[str, Any], scrub: Scrub) -> dict[str, Any]:
    doc = {k: trace[k] for k in KEEP if k in trace}
    doc["samples"] = [
        {**{k: v for k, v in s.items() if k not in SAMPLE_DROP}}
        for s in trace.get("samples", [])
        if s.get("ranks")
    ]
    doc["ras"] = [{k: a[k] for k in RAS_KEEP if k in a} for a in trace.get("ras", [])]
    daemon = dict(trace.get("daemon") or {})
    for key in ("first", "last"):  # the /hangs records: what a reader wants of them
        if isinstance(daemon.get(key), dict):
            d = daemon[key]
            daemon[key] = {
                k: d[k]
                for k in ("conditions", "signals", "reason", "signature", "where", "missing")
                if k in d
            }
    doc["daemon"] = daemon
    return dict(scrub.value(doc))


def cut_log(text: str) -> str:
    lines = text.splitlines(keepends=True)
    if len(lines) > LOG_HEAD + LOG_TAIL:
        cut = len(lines) - LOG_HEAD - LOG_TAIL
        lines = [*lines[:LOG_HEAD], f"[... {cut} lines cut ...]\n", *lines[-LOG_TAIL:]]
    out = "".join(lines)
    if len(out) > LOG_MAX:
        out = out[: LOG_MAX // 3] + "\n[... cut ...]\n" + out[-2 * LOG_MAX // 3 :]
    return out


def flight_dump(data: bytes, scrub: Scrub) -> tuple[bytes, str]:
    """The dump re-pickled with its frame paths scrubbed, or as written when unreadable."""
    sys.path.insert(0, ROOT)
    try:
        from gpuwatchd.sources.hangs import flight

        doc = flight.parse_dump(data)
    except Exception as e:
        return data, f"kept as written ({type(e).__name__}: {e})"
    return pickle.dumps(scrub.value(doc), protocol=4), "re-pickled with paths scrubbed"


def draft_expect(trace: dict[str, Any], row: dict[str, Any] | None) -> dict[str, Any]:
    """What the replay must show, from the scenario's kind (and the daemon's report)."""
    s = trace.get("scenario") or {}
    name = s.get("name", "")
    if s.get("kind") != "hang":
        out: dict[str, Any] = {"kind": "control", "max_severity": "warning"}
        if row is not None and not row.get("flagged"):
            out = {"kind": "control", "flagged": False}
        out["note"] = f"{name}: a control; never critical over the whole recording"
        return out
    alone = s.get("launch") in ("hand_rank0", "remote_rank0")
    early = s.get("mode") in EARLY  # decided on the daemon's early stacks (hangs.stacks on)
    dead = s.get("action") in DEAD_OR_MISSING or alone or early
    out = {"kind": "hang", "flagged": True, "within_s": 30 if dead else 60}
    out["alertname"] = "JobHangSuspected"
    if dead:
        out["severity"] = "critical"
        out["conditions_any"] = [
            EARLY.get(s.get("mode", ""), "rank_missing" if alone else "rank_dead")
        ]
    if early:
        out["hangs_config"] = {"stacks": True}
    if row is not None and row.get("flagged"):
        after = row.get("detected_after_s")
        if after is not None:
            out["within_s"] = max(out["within_s"], math.ceil(float(after)) + 10)
        if row.get("severity"):
            out["severity"] = row["severity"]
        if row.get("signature") not in (None, "", "pending"):
            out["signature"] = row["signature"]
    what = ", ".join(trace.get("hang_what") or []) or "no hang marker"
    out["note"] = f"{name}: {what}; drafted by tests/gpu/scenario_fixture.py"
    if trace.get("hang_start") is None:
        out["note"] += "; WARNING: the recording has no hang_start"
    return out


def summary_row(src: str, name: str, trace: dict[str, Any]) -> dict[str, Any] | None:
    """The scenario's row of the harness's summary.json, else trace.json's `daemon`."""
    path = os.path.join(os.path.dirname(os.path.abspath(src)), "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
        if not (summary.get("args") or {}).get("daemon_url", "x"):
            return None  # no daemon ran beside the harness: nothing to draft from
        for row in summary.get("rows", []):
            if row.get("scenario") == name:
                return dict(row)
    det = trace.get("daemon") or {}
    last = det.get("last") or {}
    return {
        "flagged": det.get("flagged", False),
        "detected_after_s": det.get("after_s"),
        "severity": (det.get("alert_labels") or {}).get("severity", ""),
        "signature": last.get("signature", ""),
    }


def _write(dest: str, name: str, data: bytes, gz: bool) -> str:
    if gz:
        name += ".gz"
        data = gzip.compress(data, 9, mtime=0)
    with open(os.path.join(dest, name), "wb") as f:
        f.write(data)
    return name


def provenance(trace: dict[str, Any], files: dict[str, str], dropped: list[str]) -> str:
    s = trace.get("scenario") or {}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(trace.get("t_launch", 0)))
    env0 = next(iter((trace.get("environ") or {}).values()), {})
    ras = next(
        (a["text"] for a in trace.get("ras", []) if a.get("format") == "json" and a.get("text")), ""
    )
    nccl = re.search(r'"nccl_version": "([^"]+)"', ras)
    launcher_vars = sorted(k for k in env0 if not k.startswith(("TORCH_", "NCCL_")))
    det = trace.get("daemon") or {}
    daemon = {k: det[k] for k in ("flagged", "after_s", "alert_severities") if k in det}
    hang = ", ".join(trace.get("hang_what") or []) or "none"
    if trace.get("hang_start"):
        hang += f" at +{trace['hang_start'] - trace['t_launch']:.1f} s"
    lines = [
        f"# {s.get('name', '?')} ({s.get('kind', '?')}), recorded by tests/gpu/nccl_scenarios.py",
        "",
        f"Recorded {when} on GPUs {trace.get('devices') or trace.get('gpus')} of a test machine "
        "(TODO: GPU model, driver, PyTorch version).",
        f"NCCL {nccl.group(1) if nccl else '? (no RAS answer)'}; launch `{s.get('launch')}`, "
        f"mode `{s.get('mode')}`, action `{s.get('action') or '-'}`; "
        f"job `{trace.get('job_key')}`; ranks {trace.get('ranks')}; launcher variables: "
        f"{', '.join(launcher_vars) or 'none recorded'}.",
        f"Hang: {hang}. The daemon beside the harness: {json.dumps(daemon)}.",
        f"Notes of the harness: {trace.get('notes') or 'none'}.",
        "",
        "| file | what |",
        "| --- | --- |",
    ]
    lines += [f"| `{name}` | {what} |" for name, what in files.items()]
    lines += [
        "",
        "Edits (tests/gpu/scenario_fixture.py): absolute paths of the machine replaced by "
        "`RUNDIR/...`, the checkout's prefix removed, interpreter paths read `python3` and "
        "`site-packages/...`. Dropped: " + "; ".join(dropped) + ".",
        "",
        "Replayed by `tests/hangs/test_real_scenarios_replay.py` against `expect.json`.",
        "",
    ]
    return "\n".join(lines)


def convert(src: str, dest: str, from_summary: bool = False) -> dict[str, Any]:
    """Write the fixture; returns {file: bytes written} and any warnings."""
    with open(os.path.join(src, "trace.json")) as f:
        trace = json.load(f)
    scrub = Scrub(trace)
    os.makedirs(dest, exist_ok=True)
    files: dict[str, str] = {}
    dropped = [
        "trace.json's per-sample `launchers`, the RAS answers' handshake and `parsed` fields, "
        "the daemon records but for conditions/signals/reason/signature/where",
        "the NVML rows' per-GPU `pids` (the same as `processes`), floats cut to 5 digits",
    ]
    dropped += [f"trace.json's `{k}`" for k in trace if k not in KEEP and k != "nvml"]
    nvml = nvml_rows(trace, src)
    doc = slim_trace(trace, scrub)
    big = {
        "trace.json": json.dumps(doc, separators=(",", ":")).encode(),
        "nvml.jsonl": "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in nvml).encode(),
    }
    fr_src = os.path.join(src, "fr")
    small: dict[str, bytes] = {}
    for p in trace.get("pyspy") or []:
        path = os.path.join(src, str(p.get("file", "")))
        if p.get("file") and os.path.exists(path):
            with open(path) as f:
                small[p["file"]] = scrub.text(f.read()).encode()
    for log in sorted(os.listdir(src)):
        if log.endswith(".log"):
            with open(os.path.join(src, log), errors="replace") as f:
                small[log] = scrub.text(cut_log(f.read())).encode()
    dumps: dict[str, bytes] = {}
    for name in sorted(os.listdir(fr_src)) if os.path.isdir(fr_src) else []:
        m = re.fullmatch(r"dump_(\d+)", name)
        if m:
            with open(os.path.join(fr_src, name), "rb") as f:
                data, how = flight_dump(f.read(), scrub)
            dumps[f"fr-dump-rank{m.group(1)}.pkl"] = data
            files[f"fr-dump-rank{m.group(1)}.pkl.gz"] = (
                f"rank {m.group(1)}'s flight recorder dump, {how}, gzipped"
            )
    total = sum(len(v) for v in [*big.values(), *small.values()])
    total += sum(len(gzip.compress(v, 9)) for v in dumps.values())
    gz = total > SIZE_TARGET
    described = {
        "trace.json": "the harness's trace: per-second /proc samples of each rank, RAS answers"
        " as received, environ, markers, hang_start, the daemon's detection",
        "nvml.jsonl": "NVML/GPM readings of the scenario's GPUs once a second, with each GPU's"
        " processes",
    }
    for name, data in big.items():
        written = _write(dest, name, data, gz)
        files[written] = described[name] + (
            " (gzipped: the fixture was over the size target)" if gz else ""
        )
    for name, data in small.items():
        _write(dest, name, data, False)
        files[name] = (
            "py-spy dump --native"
            if name.startswith("pyspy-")
            else f"output of {name[:-4]}, head and tail"
        )
    for name, data in dumps.items():
        _write(dest, name, data, True)
    row = summary_row(src, doc.get("scenario", {}).get("name", ""), trace) if from_summary else None
    expect = draft_expect(trace, row)
    files["expect.json"] = "what the replay must show (drafted; check by hand)"
    with open(os.path.join(dest, "expect.json"), "w") as f:
        json.dump(expect, f, indent=2)
        f.write("\n")
    with open(os.path.join(dest, "PROVENANCE.md"), "w") as f:
        f.write(provenance(doc, files, dropped))
    warnings = []
    if not nvml:
        warnings.append("no NVML rows: the monitor sees no GPU process and cannot find the job")
    if not doc.get("environ"):
        warnings.append("no environ in trace.json: the replay falls back to a 2-rank hand launch")
    left = leftover_paths(b"".join([*big.values(), *small.values()]).decode(errors="replace"))
    if left:
        warnings.append(f"absolute paths left: {left[:5]}")
    sizes = {n: os.path.getsize(os.path.join(dest, n)) for n in sorted(os.listdir(dest))}
    return {"sizes": sizes, "total": sum(sizes.values()), "warnings": warnings, "expect": expect}


def check(dest: str) -> list[str]:
    """The fixture replayed at NVML phase 0 against its expect.json (repo root on sys.path)."""
    import tempfile

    sys.path.insert(0, ROOT)
    from tests.hangs.real_trace import Trace
    from tests.hangs.scenario_replay import Expect, replaying
    from tests.hangs.scenario_replay import check as check_replay

    want = Expect.load(os.path.join(dest, "expect.json"))
    cfg = want.config()  # expect.json's hangs_config (the early stacks: hangs.stacks on)
    with tempfile.TemporaryDirectory() as tmp, replaying(tmp, Trace(dest), 0.0, cfg) as node:
        node.run()
    for t, found in node.found:
        print(f"  {t:+7.1f} s  " + "; ".join(f"{f.severity.name} {f.reason[:160]}" for f in found))
    return check_replay(node, want)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="OUT/NAME of tests/gpu/nccl_scenarios.py")
    ap.add_argument("dest", help="tests/fixtures/hangs/NAME")
    ap.add_argument(
        "--expect-from-summary", action="store_true", help="draft from the daemon's report"
    )
    ap.add_argument("--check", action="store_true", help="replay the fixture against expect.json")
    args = ap.parse_args(argv)
    got = convert(args.src, args.dest, args.expect_from_summary)
    for name, size in got["sizes"].items():
        print(f"{size:9d}  {name}")
    print(f"{got['total']:9d}  in all (target {SIZE_TARGET})")
    for w in got["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if args.check:
        bad = check(args.dest)
        print("expect.json holds" if not bad else "expect.json misses:\n  " + "\n  ".join(bad))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
