"""Series one 8-GPU HGX node exports with a given config (default: the defaults).

Starts `gpuwatchd run` on the HGX capture and sysfs of benchmarks/hgx.py
(8 H200s x 18 NVLinks, 8 ConnectX ports), waits for the NVLink error counters
and two polls, scrapes /metrics, and counts series per family.

    .venv/bin/python benchmarks/cardinality.py                  # defaults
    .venv/bin/python benchmarks/cardinality.py --nvlink-detail link
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scrape import running_daemon  # noqa: E402
from benchmarks.hgx import write_hgx  # noqa: E402

__all__ = ["count_series", "hgx_config", "main", "measure"]


def hgx_config(sysfs: Path, kmsg_file: Path, nvlink_detail: str = "", extra: str = "") -> str:
    """Config for a replayed HGX node: fixture sysfs, kernel log from a file."""
    nvml = f"  nvml: {{nvlink_detail: {nvlink_detail}}}\n" if nvlink_detail else ""
    return (
        f"paths: {{sysfs: {sysfs}}}\n"
        f"sources:\n  kmsg: {{backend: file, file: {kmsg_file}}}\n  udev: {{enabled: false}}\n"
        f"{nvml}{extra}"
    )


def count_series(text: str) -> Counter[str]:
    """Series per family name in an exposition (comments and blank lines skipped)."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] += 1
    return out


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    body = conn.getresponse().read().decode()
    conn.close()
    return body


def measure(nvlink_detail: str = "", settle: float = 30.0) -> Counter[str]:
    """Run one HGX daemon and count its series once the NVLink counters are in."""
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-card-") as tmp:
        capture, sysfs = write_hgx(Path(tmp))
        kmsg = Path(tmp) / "kern.log"
        kmsg.write_text("")
        cfg = hgx_config(sysfs, kmsg, nvlink_detail)
        with running_daemon(str(capture), cfg) as (_proc, port):
            end = time.monotonic() + settle
            counts = count_series(_get(port, "/metrics"))
            while time.monotonic() < end:
                if any(k.startswith("gpuwatchd_nvlink_") and "error" in k for k in counts):
                    break
                time.sleep(1.0)
                counts = count_series(_get(port, "/metrics"))
            time.sleep(2.0)  # a second poll: rate-based and stateful series settle
            return count_series(_get(port, "/metrics"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvlink-detail", choices=("gpu", "link"), default="")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args()
    counts = measure(args.nvlink_detail)
    total = sum(counts.values())
    own = sum(v for k, v in counts.items() if k.startswith("gpuwatchd_"))
    if args.json:
        print(json.dumps({"total": total, "gpuwatchd": own, "families": dict(counts)}, indent=1))
    else:
        for name, n in counts.most_common(25):
            print(f"{n:6d}  {name}")
        print(f"{total:6d}  total ({own} gpuwatchd_*, {len(counts)} families)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
