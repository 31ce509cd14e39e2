"""A RAS test server: speaks NCCL's client line protocol on a real loopback TCP socket
and answers STATUS with an answer recorded from NCCL 2.28.9 on an H100."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RasReplayServer:
    """Serve `json_answer` after `SET FORMAT json`, else `text_answer`; one request a connection."""

    def __init__(self, text_answer: str, json_answer: str, *, stall: bool = False) -> None:
        self.text_answer = text_answer
        self.json_answer = json_answer
        self.stall = stall  # accept, then never answer (a wedged RAS thread)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[list[str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        lines: list[str] = []
        self.requests.append(lines)
        fmt = "text"
        with conn, conn.makefile("rwb") as f:
            if self.stall:
                self._stop.wait(30)
                return
            for raw in f:
                line = raw.decode().strip()
                lines.append(line)
                upper = line.upper()
                if upper.startswith("CLIENT PROTOCOL"):
                    f.write(b"SERVER PROTOCOL 2\n")
                elif upper.startswith(("TIMEOUT", "SET FORMAT")):
                    if upper.startswith("SET FORMAT"):
                        fmt = line.split()[-1].lower()
                    f.write(b"OK\n")
                elif upper in ("STATUS", "VERBOSE STATUS"):
                    answer = self.json_answer if fmt == "json" else self.text_answer
                    f.write(answer.encode())
                    f.flush()
                    return  # the report ends when the connection closes
                else:
                    f.write(b"ERROR unknown command\n")
                f.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@contextmanager
def ras_server(text_answer: str, json_answer: str, **kw: bool) -> Iterator[RasReplayServer]:
    """A running RasReplayServer, closed afterwards."""
    server = RasReplayServer(text_answer, json_answer, **kw)
    try:
        yield server
    finally:
        server.close()
