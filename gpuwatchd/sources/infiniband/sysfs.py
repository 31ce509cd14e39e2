"""Reading InfiniBand ports from sysfs: the counter table and pure parsers.

Formats come from the kernel (drivers/infiniband/core/sysfs.c):
`state` and `phys_state` are "<id>: <name>", `rate` is
"<n> Gb/sec (<width>X <speed>)", counters are decimal numbers or
`N/A (no PMA)` when the driver has no performance-management agent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpuwatchd.ports import ERROR_COUNTERS

__all__ = [
    "COUNTERS",
    "HW_NOT_COUNTERS",
    "Port",
    "key_of",
    "parse_counter",
    "parse_rate",
    "parse_state",
    "read_port",
    "read_text",
]

# counters/<file> -> (metric name without prefix, help, multiplier)
COUNTERS: dict[str, tuple[str, str, int]] = {
    "excessive_buffer_overrun_errors": (
        "excessive_buffer_overrun_errors_total",
        "Times OverrunErrors consecutive flow-control update periods each had an overrun.",
        1,
    ),
    "link_downed": (
        "link_downed_total",
        "Times the link failed to recover from an error state and went down.",
        1,
    ),
    "link_error_recovery": (
        "link_error_recovery_total",
        "Times the link recovered from an error state.",
        1,
    ),
    "local_link_integrity_errors": (
        "local_link_integrity_errors_total",
        "Times local physical errors exceeded the LocalPhyErrors threshold.",
        1,
    ),
    "multicast_rcv_packets": (
        "multicast_packets_received_total",
        "Multicast packets received, errors included.",
        1,
    ),
    "multicast_xmit_packets": (
        "multicast_packets_transmitted_total",
        "Multicast packets transmitted, errors included.",
        1,
    ),
    "port_rcv_constraint_errors": (
        "port_constraint_errors_received_total",
        "Packets received that were discarded for constraint reasons (partition, raw).",
        1,
    ),
    "port_xmit_constraint_errors": (
        "port_constraint_errors_transmitted_total",
        "Packets not transmitted for constraint reasons.",
        1,
    ),
    "port_rcv_data": (
        "port_data_received_bytes_total",
        "Data received, in bytes (the kernel counts 4-byte words; multiplied by 4).",
        4,
    ),
    "port_xmit_data": (
        "port_data_transmitted_bytes_total",
        "Data transmitted, in bytes (the kernel counts 4-byte words; multiplied by 4).",
        4,
    ),
    "port_rcv_discards": (
        "port_discards_received_total",
        "Inbound packets discarded because the port was down or congested.",
        1,
    ),
    "port_xmit_discards": (
        "port_discards_transmitted_total",
        "Outbound packets discarded because the port was down or congested.",
        1,
    ),
    "port_rcv_errors": (
        "port_errors_received_total",
        "Packets with an error received on the port.",
        1,
    ),
    "port_rcv_packets": (
        "port_packets_received_total",
        "Packets received on all virtual lanes, errors included.",
        1,
    ),
    "port_xmit_packets": (
        "port_packets_transmitted_total",
        "Packets transmitted on all virtual lanes, errors included.",
        1,
    ),
    "port_xmit_wait": (
        "port_transmit_wait_total",
        "Ticks during which the port had data to send but sent none (congestion).",
        1,
    ),
    "unicast_rcv_packets": (
        "unicast_packets_received_total",
        "Unicast packets received, errors included.",
        1,
    ),
    "unicast_xmit_packets": (
        "unicast_packets_transmitted_total",
        "Unicast packets transmitted, errors included.",
        1,
    ),
    "port_rcv_remote_physical_errors": (
        "port_receive_remote_physical_errors_total",
        "Packets received marked with the EBP (end of bad packet) delimiter.",
        1,
    ),
    "port_rcv_switch_relay_errors": (
        "port_receive_switch_relay_errors_total",
        "Packets the switch could not forward.",
        1,
    ),
    "symbol_error": (
        "symbol_error_total",
        "Minor link errors detected on one or more physical lanes.",
        1,
    ),
    "VL15_dropped": (
        "vl15_dropped_total",
        "Incoming VL15 (subnet management) packets dropped for lack of resources.",
        1,
    ),
}

# The rules' error counters must be metrics this table exports.
assert ERROR_COUNTERS <= {f"gpuwatchd_infiniband_{c[0]}" for c in COUNTERS.values()}

# hw_counters/ entries that are settings, not counters.
HW_NOT_COUNTERS = frozenset({"lifespan"})

# --- pure parsing ------------------------------------------------------------------


def parse_state(text: str) -> tuple[int, str] | None:
    """`4: ACTIVE` -> (4, "ACTIVE"); None if malformed."""
    head, sep, name = text.strip().partition(":")
    if not sep:
        return None
    try:
        return int(head.strip()), name.strip()
    except ValueError:
        return None


def parse_rate(text: str) -> float | None:
    """`100 Gb/sec (4X EDR)` -> bytes per second (12.5e9); None if malformed."""
    parts = text.strip().split(None, 1)
    if len(parts) < 2 or not parts[1].startswith("Gb/sec"):
        return None
    try:
        return float(parts[0]) * 1e9 / 8
    except ValueError:
        return None


def parse_counter(text: str) -> int | None:
    """A counter file's value; None for `N/A (no PMA)` or anything not a number."""
    value = text.strip()
    if not value or value.startswith("N/A"):
        return None
    try:
        return int(value, 0)
    except ValueError:
        return None


# --- reading ------------------------------------------------------------------------


@dataclass
class Port:
    """One port as read from sysfs in one poll."""

    device: str
    port: str
    state_id: int | None = None
    state: str = ""
    phys_state_id: int | None = None
    phys_state: str = ""
    rate: float | None = None
    link_layer: str = ""
    counters: dict[str, int] = field(default_factory=dict)  # file name -> raw value
    hw_counters: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # reasons, for the errors counter


def read_text(path: str) -> str | None:
    """A sysfs attribute's text, or None if it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _read_dir_counters(path: str, port: Port, into: dict[str, int]) -> None:
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return
    except OSError:
        port.problems.append("unreadable")
        return
    for name in names:
        text = read_text(os.path.join(path, name))
        if text is None:
            if os.path.isfile(os.path.join(path, name)):
                port.problems.append("unreadable")
            continue
        value = parse_counter(text)
        if value is not None:
            into[name] = value
        elif not text.strip().startswith("N/A"):
            port.problems.append("unparsable")


def read_port(port_dir: str, device: str, port: str, hw_counters: bool = True) -> Port:
    """Read one ports/<n>/ directory; missing or bad files become problems, not errors."""
    p = Port(device, port)
    for attr, id_attr, fname in (
        ("state", "state_id", "state"),
        ("phys_state", "phys_state_id", "phys_state"),
    ):
        text = read_text(os.path.join(port_dir, fname))
        parsed = parse_state(text) if text is not None else None
        if parsed is None:
            p.problems.append("unreadable" if text is None else "unparsable")
        else:
            setattr(p, id_attr, parsed[0])
            setattr(p, attr, parsed[1])
    text = read_text(os.path.join(port_dir, "rate"))
    p.rate = parse_rate(text) if text is not None else None
    if p.rate is None:
        p.problems.append("unreadable" if text is None else "unparsable")
    p.link_layer = (read_text(os.path.join(port_dir, "link_layer")) or "").strip()
    _read_dir_counters(os.path.join(port_dir, "counters"), p, p.counters)
    if hw_counters:
        _read_dir_counters(os.path.join(port_dir, "hw_counters"), p, p.hw_counters)
    return p


def key_of(device: str, port: str) -> str:
    """The `device/port` key used in config (expected_rate_gbps, expected_up) and status."""
    return f"{device}/{port}"
