"""A client for NCCL's RAS service, and its JSON answer as typed values.

Every NCCL process since 2.24 runs a RAS thread that answers on
localhost:28028 (or the job's NCCL_RAS_ADDR). The line protocol:
`CLIENT PROTOCOL 2` -> `SERVER PROTOCOL n`, optional `TIMEOUT n` -> `OK`,
optional `SET FORMAT json` -> `OK`, then `STATUS` or `VERBOSE STATUS`,
answered by a report that ends when the server closes the connection.
Every step here has a deadline; fields added by newer NCCL releases are
kept in `extra` and used where present, never required.

`query_in_netns` runs the query in a short-lived child that joins a
process's network namespace first (a pod's localhost), opt-in: it needs
CAP_SYS_ADMIN and the host PID namespace.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from gpuwatchd.jobview import RasAnswer, RasCommunicator, RasError, RasRank, RasReport

__all__ = [
    "PROTOCOL",
    "RasAnswer",
    "RasCommunicator",
    "RasError",
    "RasRank",
    "RasReport",
    "parse_addr",
    "parse_report",
    "query",
    "query_in_netns",
]

PROTOCOL = 2
MAX_ANSWER_BYTES = 8 << 20


def parse_addr(addr: str, default_port: int = 28028) -> tuple[str, int]:
    """`host:port`, `[v6]:port`, `host` or `:port` -> (host, port)."""
    addr = addr.strip()
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest.lstrip(":")
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:
        host, port = addr, ""
    try:
        return host or "localhost", int(port) if port else default_port
    except ValueError as e:
        raise RasError(f"bad RAS address {addr!r}") from e


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dict(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


_RANK_KEYS = {"rank", "host", "pid", "cuda_dev", "nvml_dev", "status", "collective_counts"}
_STATUS_KEYS = {"init_state", "async_error", "finalize_called", "destroy_flag", "abort_flag"}
_COMM_KEYS = {"hash", "size", "ranks", "ranks_count", "missing_ranks", "missing_ranks_count"}


def _rank(raw: Mapping[str, object]) -> RasRank:
    status = _dict(raw.get("status"))
    counts = {str(k): _int(v) for k, v in _dict(raw.get("collective_counts")).items()}
    extra = {k: v for k, v in raw.items() if k not in _RANK_KEYS}
    extra.update({f"status.{k}": v for k, v in status.items() if k not in _STATUS_KEYS})
    return RasRank(
        rank=_int(raw.get("rank"), -1),
        host=str(raw.get("host", "")),
        pid=_opt_int(raw.get("pid")),
        cuda_dev=_opt_int(raw.get("cuda_dev")),
        nvml_dev=_opt_int(raw.get("nvml_dev")),
        init_state=_int(status.get("init_state")),
        async_error=_int(status.get("async_error")),
        finalize_called=status.get("finalize_called") is True,
        destroy_flag=status.get("destroy_flag") is True,
        abort_flag=status.get("abort_flag") is True,
        collective_counts=counts,
        extra=extra,
    )


# NCCL 2.28.9 writes a missing rank as `"nvml_dev": 1` and `"status": {` on
# consecutive lines without the comma between them; JSON needs one there.
_MISSING_COMMA = re.compile(r'([0-9"\]}]|true|false|null)(\s*\n\s*")')


def _load_json(text: str) -> object:
    """json.loads, retried once with the commas NCCL 2.28.9 leaves out put back."""
    try:
        return json.loads(text)
    except ValueError as first:
        try:
            return json.loads(_MISSING_COMMA.sub(r"\1,\2", text))
        except ValueError:
            raise RasError(f"RAS answer is not JSON: {first}") from first


def parse_report(text: str) -> RasReport:
    """Parse a JSON `STATUS` answer (also 2.28.9's malformed one); RasError when not one."""
    doc = _load_json(text)
    if not isinstance(doc, dict):
        raise RasError("RAS answer is not a JSON object")
    comms = []
    for raw in _list(doc.get("communicators")):
        c = _dict(raw)
        ranks = tuple(_rank(_dict(r)) for r in _list(c.get("ranks")))
        missing = tuple(_dict(m) for m in _list(c.get("missing_ranks")))
        comms.append(
            RasCommunicator(
                hash=str(c.get("hash", "")),
                size=_int(c.get("size"), len(ranks)),
                ranks=ranks,
                missing_ranks=missing,
                missing_ranks_count=_int(c.get("missing_ranks_count"), len(missing)),
                extra={k: v for k, v in c.items() if k not in _COMM_KEYS},
            )
        )
    ras = _dict(doc.get("ras"))
    collection = ras.get("collection_time_sec")
    known = {"nccl_version", "communicators", "communicators_count", "ras"}
    return RasReport(
        nccl_version=str(doc.get("nccl_version", "")),
        communicators=tuple(comms),
        timeouts_count=_int(ras.get("timeouts_count")),
        collection_time_seconds=float(collection) if isinstance(collection, int | float) else None,
        extra={k: v for k, v in doc.items() if k not in known},
    )


class _Conn:
    """A socket with one overall deadline for every read and write."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        self.deadline = deadline
        self.buf = b""
        try:
            self.sock = socket.create_connection((host, port), timeout=self._left())
        except OSError as e:
            raise RasError(f"cannot connect to RAS at {host}:{port}: {e}") from e

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RasError("RAS query timed out")
        return left

    def send(self, line: str) -> None:
        self.sock.settimeout(self._left())
        try:
            self.sock.sendall(line.encode() + b"\n")
        except OSError as e:
            raise RasError(f"RAS write failed: {e}") from e

    def _recv(self) -> bytes:
        self.sock.settimeout(self._left())
        try:
            return self.sock.recv(65536)
        except TimeoutError as e:
            raise RasError("RAS query timed out") from e
        except OSError as e:
            raise RasError(f"RAS read failed: {e}") from e

    def line(self) -> str:
        while b"\n" not in self.buf:
            chunk = self._recv()
            if not chunk:
                raise RasError("RAS closed the connection during the handshake")
            self.buf += chunk
            if len(self.buf) > 4096:
                raise RasError("RAS handshake line too long")
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    def rest(self) -> str:
        data = self.buf
        while True:
            chunk = self._recv()
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER_BYTES:
                raise RasError("RAS answer too large")
        return data.decode(errors="replace")

    def close(self) -> None:
        self.sock.close()


def query(
    addr: str,
    *,
    fmt: str = "json",
    verbose: bool = False,
    collective_timeout: int | None = 5,
    timeout: float = 10.0,
) -> RasAnswer:
    """Ask one RAS service for its status, all within `timeout` seconds."""
    host, port = parse_addr(addr)
    start = time.monotonic()
    conn = _Conn(host, port, start + timeout)
    try:
        conn.send(f"CLIENT PROTOCOL {PROTOCOL}")
        hello = conn.line()
        if not hello.upper().startswith("SERVER PROTOCOL "):
            raise RasError(f"unexpected RAS handshake: {hello[:80]!r}")
        try:
            server_protocol = int(hello.split()[2])
        except (IndexError, ValueError):
            server_protocol = 0
        if collective_timeout is not None:
            conn.send(f"TIMEOUT {int(collective_timeout)}")
            _expect_ok(conn.line(), "TIMEOUT")
        if fmt != "text":
            conn.send(f"SET FORMAT {fmt}")
            _expect_ok(conn.line(), "SET FORMAT")
        conn.send(("VERBOSE " if verbose else "") + "STATUS")
        text = conn.rest()
    finally:
        conn.close()
    report = parse_report(text) if fmt == "json" else None
    return RasAnswer(addr, server_protocol, text, report, time.monotonic() - start)


def _expect_ok(line: str, what: str) -> None:
    if line.upper() != "OK":
        raise RasError(f"RAS refused {what}: {line[:80]!r}")


# --- joining a process's network namespace -----------------------------------------

_CLONE_NEWNET = 0x40000000


def _setns_net(pid: int) -> None:
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the network namespace of pid {pid}: {os.strerror(err)}")
    finally:
        os.close(fd)


def query_in_netns(
    pid: int,
    addr: str,
    *,
    verbose: bool = False,
    timeout: float = 10.0,
    python: str = sys.executable,
) -> RasAnswer:
    """Run `query` in a short-lived child inside pid's network namespace (CAP_SYS_ADMIN)."""
    cmd = [python, "-m", "gpuwatchd.sources.hangs.ras", str(pid), addr, str(timeout)]
    if verbose:
        cmd.append("verbose")
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout + 2, check=False)
    except subprocess.TimeoutExpired as e:
        raise RasError(f"RAS query in the network namespace of pid {pid} timed out") from e
    if done.returncode != 0:
        msg = done.stderr.decode(errors="replace").strip().splitlines()
        raise RasError(msg[-1] if msg else f"RAS query child exited {done.returncode}")
    out = json.loads(done.stdout)
    text = str(out["text"])
    return RasAnswer(addr, int(out["protocol"]), text, parse_report(text), time.monotonic() - start)


def _child(argv: Sequence[str]) -> int:
    pid, addr, timeout = int(argv[0]), argv[1], float(argv[2])
    try:
        _setns_net(pid)
        answer = query(addr, verbose="verbose" in argv[3:], timeout=timeout)
    except (OSError, RasError) as e:
        print(str(e), file=sys.stderr)
        return 1
    json.dump({"protocol": answer.server_protocol, "text": answer.text}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
