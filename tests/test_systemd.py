from __future__ import annotations

import os
import socket
from pathlib import Path

from gpuwatchd.systemd import Notifier


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    return sock


def test_no_socket_is_a_no_op() -> None:
    n = Notifier(env={})
    assert not n.enabled
    assert n.ready() is False
    assert n.watchdog_interval() is None


def test_messages_reach_a_real_datagram_socket(tmp_path: Path) -> None:
    sock = _listen(tmp_path / "notify")
    n = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert n.ready("2 GPU(s)")
    assert sock.recv(4096) == b"READY=1\nSTATUS=2 GPU(s)"
    n.reloading()
    msg = sock.recv(4096).decode()
    assert msg.startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert int(msg.rsplit("=", 1)[1]) > 0
    n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    n.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    sock.close()


def test_abstract_socket_address() -> None:
    name = f"gpuwatchd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    Notifier(env={"NOTIFY_SOCKET": "@" + name}).status("fine")
    assert sock.recv(4096) == b"STATUS=fine"
    sock.close()


def test_watchdog_interval_is_half_and_respects_pid() -> None:
    mine = Notifier(
        env={"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}
    )
    assert mine.watchdog_interval() == 5.0
    other = Notifier(env={"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval() is None


def test_notify_never_blocks_on_a_receiver_that_does_not_read(tmp_path: Path) -> None:
    """A full notify queue drops messages; it used to block the sender (and, through
    systemd-python, every thread of the daemon) until the receiver read."""
    import threading

    path = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)  # never read
    try:
        notifier = Notifier({"NOTIFY_SOCKET": path})
        sent = threading.Thread(
            target=lambda: [notifier.watchdog() for _ in range(5000)], daemon=True
        )
        sent.start()
        sent.join(timeout=10)
        assert not sent.is_alive(), "sd_notify blocked on a full queue"
        assert notifier.dropped > 0
    finally:
        receiver.close()
