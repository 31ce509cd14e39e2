#!/usr/bin/env python3
"""`gpuwatchd check` on a real GPU: OK when healthy, CRITICAL after a real Xid 31
configured critical, OK again after `gpuwatchd clear`.

Needs root (to read /dev/kmsg), an NVIDIA GPU and its driver; nothing else:
the Xid 31 comes from a CUDA kernel, given as PTX to the driver API through
ctypes, that writes to an unmapped address (the driver JIT-compiles PTX, so
no CUDA toolkit is needed). Run from the repository root:

    sudo python3 tests/gpu/check_xid31.py [--out result.json]

Prints one JSON object; exit status 0 when every step gave the expected
exit code (0, then 1 with the catalog's default warning, 2 with Xid 31
configured critical, 0 after the clear).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from faults import illegal_write_ptx  # noqa: E402  (tests/gpu is on sys.path)

from gpuwatchd import config  # noqa: E402
from gpuwatchd.cli import check as checkcmd  # noqa: E402
from gpuwatchd.cli import clear as clearcmd  # noqa: E402
from gpuwatchd.sources import SourceSpec, registry  # noqa: E402


def cuda_illegal_write() -> dict[str, Any]:
    """Launch one thread that stores to an unmapped GPU address; returns CUDA's verdict."""
    r = illegal_write_ptx()
    return {k: r[k] for k in ("launch", "synchronize", "launched_at", "pid")}


def run_check(cfg: config.Config) -> dict[str, Any]:
    started = time.monotonic()
    verdict = checkcmd.check(cfg, timeout=30)
    return {
        "exit_code": verdict.exit_code,
        "status": verdict.status,
        "seconds": round(time.monotonic() - started, 2),
        "gpus": verdict.gpus,
        "conditions": [
            f"{f.severity} {f.alertname} {dict(f.subject)} {dict(f.labels)}: {f.reason}"
            for f in verdict.findings
        ],
        "sources": {p.name: p.describe() for p in verdict.polled.values()},
        "report": checkcmd.render_text(verdict, cfg),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the result JSON here")
    args = parser.parse_args()
    if "kmsg" not in registry():  # older trees register only the polled sources
        from gpuwatchd.sources.kmsg import source as kmsg

        registry()["kmsg"] = SourceSpec(kmsg.KmsgSource.from_config, True, kmsg.METRICS)

    state = tempfile.mkdtemp(prefix="gpuwatchd-check-")
    base = config.load_text(f"daemon: {{state_dir: {state}}}\n")
    critical = config.load_text(
        f"daemon: {{state_dir: {state}}}\n"
        "xid: {overrides: {'31': {severity: critical, action: reset_gpu}}}\n"
    )
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result["healthy"] = run_check(base)
    result["cuda"] = cuda_illegal_write()
    time.sleep(1.0)  # the driver prints the Xid within a second or two of the fault
    for _ in range(10):
        result["after_xid31_default"] = run_check(base)
        if result["after_xid31_default"]["exit_code"] != 0:
            break
        time.sleep(1.0)
    result["after_xid31_critical"] = run_check(critical)

    clear = argparse.Namespace(
        gpu="0", all=False, xid=None, reason="check_xid31.py drill", config=None, state_dir=state
    )
    cfg_file = Path(state) / "config.yaml"
    cfg_file.write_text(f"daemon: {{state_dir: {state}}}\n")
    clear.config = str(cfg_file)
    result["clear_exit_code"] = clearcmd._run_clear(clear)
    result["after_clear_critical"] = run_check(critical)

    codes = [
        result[k]["exit_code"]
        for k in ("healthy", "after_xid31_default", "after_xid31_critical", "after_clear_critical")
    ]
    result["exit_codes"] = codes
    result["ok"] = codes == [0, 1, 2, 0] and result["cuda"]["synchronize"] == 700
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
