"""Floods against the HTTP server: memory before and after, and the scrapes meanwhile.

gpuwatchd (2-GPU replay) beside Go node_exporter (Debian package
`prometheus-node-exporter`, a few light collectors; skipped when absent),
each started fresh for each attack, on loopback:

- scrape+idle: 8 clients scrape /metrics in a loop while one idle client
  connects, waits 4 s and closes, again and again (plain HTTP, no auth);
- bad-password: 80 clients send random wrong passwords (basic auth, bcrypt
  cost 10) while Prometheus scrapes with the right one;
- json-route: 32 clients fetch the server's largest page in a loop
  (gpuwatchd: /events?limit=1000 with 1,000 stored events of ~2 KB;
  node_exporter has no JSON route: its /metrics) and 1,000 more ask for it
  and never read, while Prometheus scrapes /metrics.

The attack runs in a separate process, bounded in seconds and requests.
Reported: scrapes that succeeded and their p50/p99, the server's VmRSS
before the attack (after a warm-up), its peak during and 2 s after.

    .venv/bin/python benchmarks/bench_http_floods.py --section http-floods
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.asyncio_http import daemon_command  # noqa: E402
from benchmarks.report import publish, update_section  # noqa: E402

PASSWORD = "bench-password"
REPLAY = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-record.json"
NODE_EXPORTER = ("prometheus-node-exporter", "node_exporter")
ATTACKS = ("scrape+idle", "bad-password", "json-route")
MB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fetch(port: int, path: str, header: str = "", timeout: float = 5.0) -> int:
    """One GET on a new connection, read to the end: the status, 0 if it failed."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(
                f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{header}\r\n".encode()
            )
            first = s.recv(65536)
            while s.recv(262144):
                pass
    except OSError:
        return 0
    return int(first[9:12]) if first[9:12].isdigit() else 0


def basic(user: str, password: str) -> str:
    return "Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def seed_events(state: Path, count: int) -> None:
    """`count` old Xid events of ~2 KB each, as a long-lived node's store holds."""
    from gpuwatchd.model import Event, Severity
    from gpuwatchd.sinks.store import DB_NAME, EventStore

    state.mkdir(parents=True, exist_ok=True)
    store = EventStore(str(state / DB_NAME))
    old = time.time() - 5 * 86400
    raw = f"NVRM: Xid (PCI:0000:18:00): 13, {'x' * 1800}"
    store.write(
        [
            (
                Event(
                    "xid",
                    "kmsg",
                    old + i,
                    13,
                    "00000000:18:00.0",
                    "Graphics Engine Exception",
                    Severity.WARNING,
                    (("raw", raw),),
                ),
                f"b{i}",
                1,
            )  # fmt: skip
            for i in range(count)
        ]
    )
    store.close()


def attacker(attack: str, port: int, page: str, args: Any, ready: Any, stop: Any, out: Any) -> None:
    """The flood, in its own process: threads in loops until `stop` or the request cap."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sent = [0]
    lock = threading.Lock()
    held: list[socket.socket] = []

    def loop(work: Callable[[int], object], n: int) -> None:
        i = 0
        while not stop.is_set():
            with lock:
                if sent[0] >= args.max_requests:
                    return
                sent[0] += 1
            work(n * 1_000_000 + i)
            i += 1

    def idle(_i: int) -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10):
                stop.wait(4.0)
        except OSError:
            time.sleep(0.1)

    works: list[tuple[Callable[[int], object], int]] = []
    if attack == "scrape+idle":
        works = [(lambda i: fetch(port, "/metrics"), 8), (idle, 1)]
    elif attack == "bad-password":
        works = [(lambda i: fetch(port, "/metrics", basic("prom", f"wrong-{i}") + "\r\n"), 80)]
    else:
        works = [(lambda i: fetch(port, page), 32)]
        for _ in range(args.non_readers):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(f"GET {page} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                held.append(s)
            except OSError:
                break
    threads = [
        threading.Thread(target=loop, args=(w, n), daemon=True)
        for w, count in works
        for n in range(count)
    ]
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join()
    out.put((sent[0], len(held)))
    for s in held:
        s.close()


@contextmanager
def started(cmd: list[str], port: int, header: str) -> Iterator[int]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while fetch(port, "/metrics", header) != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} did not come up")
            time.sleep(0.2)
        yield proc.pid
    finally:
        proc.terminate()
        proc.wait(15)


def settled(pid: int) -> int:
    lows = []
    for _ in range(5):
        time.sleep(0.2)
        lows.append(rss(pid))
    return min(lows)


def measure(
    attack: str, pid: int, port: int, page: str, header: str, args: Any
) -> dict[str, float]:
    def warm() -> None:
        for _ in range(5):
            fetch(port, "/metrics", header)
            fetch(port, page, header)

    warmers = [threading.Thread(target=warm) for _ in range(8)]  # every worker and its arena
    for t in warmers:
        t.start()
    for t in warmers:
        t.join()
    before = settled(pid)
    mpc = mp.get_context("fork")
    ready, stop, out = mpc.Event(), mpc.Event(), mpc.Queue()
    proc = mpc.Process(target=attacker, args=(attack, port, page, args, ready, stop, out))
    proc.start()
    ready.wait(60)
    peak = rss(pid)
    lat: list[float | None] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        ok = fetch(port, "/metrics", header) == 200
        lat.append(time.perf_counter() - t0 if ok else None)
        peak = max(peak, rss(pid))
        time.sleep(args.interval)
    stop.set()
    sent, held = out.get(timeout=60)
    proc.join(30)
    time.sleep(2.0)
    after = rss(pid)
    ok = sorted(x for x in lat if x is not None)
    return {
        "scrapes": float(len(lat)),
        "scrapes_ok": float(len(ok)),
        "p50_ms": pct(ok, 0.5) * 1e3,
        "p99_ms": pct(ok, 0.99) * 1e3,
        "rss_before_mb": before / MB,
        "rss_peak_mb": peak / MB,
        "rss_after_mb": after / MB,
        "attack_requests": float(sent),
        "attack_non_readers": float(held),
    }


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each attack")
    ap.add_argument("--max-requests", type=int, default=200_000, help="cap per attack")
    ap.add_argument("--non-readers", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between scrapes")
    ap.add_argument("--only", choices=("gpuwatchd", "node_exporter"), help="one server")
    ap.add_argument("--section", default="", help="docs/benchmarks.md section name")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    import resource

    import bcrypt

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatchd-bench-"))
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    web = tmp / "web.yml"
    web.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    exe = next((shutil.which(n) for n in NODE_EXPORTER if shutil.which(n)), None)
    fig: dict[str, Any] = {"seconds": args.seconds}
    for attack in args.attacks:
        auth = attack == "bad-password"
        header = basic("prom", PASSWORD) + "\r\n" if auth else ""
        fig[attack] = {}
        if args.only != "node_exporter":
            run = tmp / f"gpuwatchd-{attack}"
            seed_events(run / "state", 1000 if attack == "json-route" else 0)
            port = free_port()
            (run / "config.yaml").write_text(
                (f"http:\n  web_config_file: {web}\n" if auth else "")
                + "sources:\n  kmsg: {enabled: false}\n  udev: {enabled: false}\n"
            )
            cmd = [*daemon_command(), "run", "--config", str(run / "config.yaml"),
                   "--listen", f"127.0.0.1:{port}", "--state-dir", str(run / "state"),
                   "--nvml-replay", str(REPLAY), "--log-level", "warning"]  # fmt: skip
            with started(cmd, port, header) as pid:
                page = "/events?limit=1000"
                fig[attack]["gpuwatchd"] = measure(attack, pid, port, page, header, args)
        if exe and args.only != "gpuwatchd":
            port = free_port()
            light = ["--collector.disable-defaults", "--collector.loadavg", "--collector.meminfo"]
            cmd = [exe, f"--web.listen-address=127.0.0.1:{port}", *light]
            if auth:
                cmd.append(f"--web.config.file={web}")
            with started(cmd, port, header) as pid:
                fig[attack]["node_exporter"] = measure(attack, pid, port, "/metrics", header, args)
    shutil.rmtree(tmp, ignore_errors=True)
    publish(fig, "HTTP floods", [], "", args.json or "")
    if args.section:
        update_section(args.section, report(fig, args))
    return 0


def report(fig: dict[str, Any], args: Any) -> str:
    rows = [
        "| attack | server | scrapes OK | p50 | p99 | RSS before | peak | 2 s after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    for attack in args.attacks:
        for name in ("gpuwatchd", "node_exporter"):
            f = fig[attack].get(name)
            if f is None:
                rows.append(f"| {attack} | {name} | not installed: skipped | | | | | |")
                continue
            rows.append(
                f"| {attack} | {name} | {f['scrapes_ok']:.0f}/{f['scrapes']:.0f} | "
                f"{f['p50_ms']:.1f} ms | {f['p99_ms']:.1f} ms | {f['rss_before_mb']:.1f} MB | "
                f"{f['rss_peak_mb']:.1f} MB | {f['rss_after_mb']:.1f} MB |"
            )
        g, n = fig[attack].get("gpuwatchd"), fig[attack].get("node_exporter")
        if g and n:
            ratios.append(
                f"{attack}: p50 {g['p50_ms'] / n['p50_ms']:.2f}x, "
                f"RSS growth {g['rss_after_mb'] - g['rss_before_mb']:+.1f} MB vs "
                f"{n['rss_after_mb'] - n['rss_before_mb']:+.1f} MB"
            )
    note = (
        f"\n\nEach attack ran {args.seconds:.0f} s from a separate process against a fresh "
        "server; scrapes every "
        f"{args.interval * 1e3:.0f} ms on new connections (with the right password in the "
        "bad-password attack). The json-route attack fetches each server's largest page "
        "(gpuwatchd: /events?limit=1000 with 1,000 stored events; node_exporter: /metrics) "
        f"and holds {args.non_readers} clients that asked for it and never read. "
        "gpuwatchd / node_exporter: " + ("; ".join(ratios) or "node_exporter not run") + ". "
        f"Load average at the end: {os.getloadavg()[0]:.1f}."
    )
    title = "## HTTP floods: scrapes and memory under attack (http-floods)\n\n"
    return title + "\n".join(rows) + note


if __name__ == "__main__":
    raise SystemExit(main())
