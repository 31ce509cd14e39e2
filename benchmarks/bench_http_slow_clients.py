"""Scrape latency while 1,000 slow clients hold connections: gpuwatchd beside node_exporter.

Both servers get the same web-config (TLS and basic auth), as on a node. A
separate attacker process keeps N connections open to the server under test,
in four kinds: idle (TCP only, not even a ClientHello), half-handshaken (a
ClientHello, then silence), a header slowloris (handshake done, request head
trickled a byte every 0.5 s) and a trickle after the response (a request,
then a byte every 0.5 s). Whatever the server closes is reopened, so the
pressure holds. Meanwhile an authenticated client scrapes /metrics with a new
TLS connection each time and reports p50/p99 latency and failures; a run
without the attack gives the baseline. node_exporter (Debian package
`prometheus-node-exporter`) runs with a few light collectors, so its figures
show its HTTP server rather than its collection; without it that half is
skipped.

    python benchmarks/bench_http_slow_clients.py --section http-slow-clients
"""

from __future__ import annotations

import argparse
import base64
import http.client
import multiprocessing as mp
import os
import resource
import selectors
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.asyncio_http import daemon_command  # noqa: E402
from benchmarks.report import publish  # noqa: E402

PASSWORD = "bench-password"
REPLAY = ROOT / "tests" / "fixtures" / "nvml" / "h100-idle-record.json"
KINDS = ("idle", "hello", "head", "after")
TRICKLE_SECONDS = 0.5
NODE_EXPORTER = ("prometheus-node-exporter", "node_exporter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def write_pki(d: Path) -> tuple[Path, Path]:
    """A CA, a server certificate for 127.0.0.1 and a web-config.yml with one user."""
    import bcrypt
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(d / "server.pem")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    (d / "web.yml").write_text(
        f"tls_server_config:\n  cert_file: {d / 'server.pem'}\n  key_file: {d / 'server.pem'}\n"
        f"basic_auth_users:\n  prom: '{hashed}'\n"
    )
    return d / "ca.pem", d / "web.yml"


def scrape(port: int, ctx: ssl.SSLContext, path: str = "/metrics") -> float | None:
    """Seconds for one authenticated scrape on a new connection; None if it failed."""
    token = base64.b64encode(f"prom:{PASSWORD}".encode()).decode()
    t0 = time.perf_counter()
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Basic {token}"})
        resp = conn.getresponse()
        resp.read()
        ok = resp.status == 200
    except (OSError, http.client.HTTPException):
        ok = False
    finally:
        conn.close()
    return time.perf_counter() - t0 if ok else None


@contextmanager
def started(cmd: list[str], port: int, ctx: ssl.SSLContext) -> Iterator[int]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while scrape(port, ctx) is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} did not come up")
            time.sleep(0.2)
        yield proc.pid
    finally:
        proc.terminate()
        proc.wait(15)


def client_hello() -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def attacker(
    port: int, ca: str, count: int, kinds: tuple[str, ...], ready: Any, stop: Any, out: Any
) -> None:
    """Hold `count` slow connections of the four kinds, reopening what the server closes."""
    raise_nofile()
    ctx = ssl.create_default_context(cafile=ca)
    hello = client_hello()
    sel = selectors.DefaultSelector()
    reopened = failed = 0

    def open_one(kind: str) -> None:
        nonlocal failed
        try:
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock: socket.socket = raw
            if kind == "hello":
                raw.sendall(hello)
            elif kind in ("head", "after"):
                sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                sock.sendall(
                    b"GET /metrics HTTP/1.1\r\n" if kind == "head" else b"GET / HTTP/1.1\r\n\r\n"
                )
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, kind)
        except (OSError, ValueError):
            failed += 1

    for i in range(count):
        open_one(kinds[i % len(kinds)])
    ready.set()
    next_trickle = time.monotonic() + TRICKLE_SECONDS
    while not stop.is_set():
        for key, _ in sel.select(max(0.0, next_trickle - time.monotonic())):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                gone = sock.recv(65536) == b""
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                gone = False
            except OSError:
                gone = True
            if gone:
                sel.unregister(sock)
                sock.close()
                reopened += 1
                open_one(str(key.data))
        if time.monotonic() >= next_trickle:
            next_trickle += TRICKLE_SECONDS
            for key in list(sel.get_map().values()):
                if key.data in ("head", "after"):
                    try:
                        key.fileobj.send(b"X")  # type: ignore[union-attr]
                    except (OSError, ValueError):
                        pass
    out.put((reopened, failed, len(sel.get_map())))
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(
    pid: int, port: int, ca: Path, ctx: ssl.SSLContext, args: argparse.Namespace
) -> dict[str, float]:
    base = [scrape(port, ctx) for _ in range(args.baseline)]
    rss_before = rss_mb(pid)
    mpc = mp.get_context("fork")
    ready, stop, out = mpc.Event(), mpc.Event(), mpc.Queue()
    proc = mpc.Process(
        target=attacker, args=(port, str(ca), args.clients, tuple(args.kinds), ready, stop, out)
    )
    proc.start()
    t0 = time.monotonic()
    ready.wait(120)
    setup = time.monotonic() - t0
    time.sleep(1.0)
    lat: list[float | None] = []
    for _ in range(args.scrapes):
        lat.append(scrape(port, ctx))
        time.sleep(args.interval)
    rss_during = rss_mb(pid)
    stop.set()
    reopened, failed, held = out.get(timeout=30)
    proc.join(30)
    time.sleep(2.0)
    ok = sorted(x for x in lat if x is not None)
    okb = sorted(x for x in base if x is not None)
    return {
        "baseline_p50_ms": pct(okb, 0.5) * 1e3,
        "p50_ms": pct(ok, 0.5) * 1e3,
        "p99_ms": pct(ok, 0.99) * 1e3,
        "failures": float(len(lat) - len(ok)),
        "over_100ms": float(sum(1 for x in ok if x > 0.1)),
        "attack_setup_s": setup,
        "attack_reopened": float(reopened),
        "attack_open_failed": float(failed),
        "attack_held_at_end": float(held),
        "rss_before_mb": rss_before,
        "rss_during_mb": rss_during,
        "rss_after_mb": rss_mb(pid),
    }


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--baseline", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between scrapes")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--only", choices=("gpuwatchd", "node_exporter"), help="one server")
    ap.add_argument("--section", default="", help="docs/benchmarks.md section name")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatchd-bench-"))
    ca, web = write_pki(tmp)
    ctx = ssl.create_default_context(cafile=str(ca))
    fig: dict[str, object] = {"clients": args.clients, "scrapes": args.scrapes}
    port = free_port()
    (tmp / "config.yaml").write_text(
        f"http:\n  web_config_file: {web}\nsources:\n  nvml: {{replay: {REPLAY}}}\n"
        "  kmsg: {enabled: false}\n  udev: {enabled: false}\n"
    )
    cmd = [*daemon_command(), "run", "--config", str(tmp / "config.yaml"),
           "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp / "state"),
           "--log-level", "warning"]  # fmt: skip
    if args.only != "node_exporter":
        with started(cmd, port, ctx) as pid:
            fig["gpuwatchd"] = measure(pid, port, ca, ctx, args)
    exe = next((shutil.which(n) for n in NODE_EXPORTER if shutil.which(n)), None)
    if exe and args.only != "gpuwatchd":
        port = free_port()
        light = ["--collector.disable-defaults", "--collector.loadavg", "--collector.meminfo"]
        cmd = [exe, f"--web.listen-address=127.0.0.1:{port}", f"--web.config.file={web}", *light]
        with started(cmd, port, ctx) as pid:
            fig["node_exporter"] = measure(pid, port, ca, ctx, args)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name in ("gpuwatchd", "node_exporter"):
        f = fig.get(name)
        if not isinstance(f, dict):
            rows.append(f"| {name} | not installed: skipped | | | | | |")
            continue
        rows.append(
            f"| {name} | {f['baseline_p50_ms']:.1f} ms | {f['p50_ms']:.1f} ms | "
            f"{f['p99_ms']:.1f} ms | {f['over_100ms']:.0f} | {f['failures']:.0f} | "
            f"{f['rss_before_mb']:.0f} / {f['rss_during_mb']:.0f} / {f['rss_after_mb']:.0f} MB |"
        )
    title = (
        f"Scrapes under {args.clients} slow clients ({args.scrapes} authenticated TLS scrapes, "
        "each on a new connection)"
    )
    header = [
        "| server | p50 alone | p50 under attack | p99 under attack | over 100 ms | failed "
        "| RSS before / under attack / 2 s after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    publish(fig, title, [], "", args.json or "")
    if args.section:
        from benchmarks.report import update_section

        kinds = ", ".join(args.kinds)
        note = (
            f"\n\nEach server held {args.clients} slow clients ({kinds}; reopened when closed) "
            "from a separate process while the scrapes ran; over 100 ms and failed count "
            f"scrapes under attack. Load average at the end: {os.getloadavg()[0]:.1f}."
        )
        table = "\n".join(header + rows)
        update_section(args.section, f"## {title} ({args.section})\n\n{table}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
