"""Drain and resume this node in Slurm with `scontrol`, bounded in time.

The fleet-wide guard reads Slurm itself: how many nodes carry a drain
reason of ours set within the guard window. Many daemons that see the same
fault (a bad switch, a driver push) therefore stop after `max_drains`.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from gpuwatchd.config import Config
from gpuwatchd.errors import GpuwatchdError

__all__ = ["SlurmError", "SlurmNode", "SlurmNodes", "parse_sinfo"]

log = logging.getLogger("gpuwatchd.remediation")

_SINFO_FORMAT = "%N|%T|%H|%E"


class SlurmError(GpuwatchdError):
    """scontrol or sinfo failed, timed out, or is missing."""


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """One node as sinfo lists it."""

    name: str
    state: str
    reason_time: float
    reason: str

    @property
    def drained(self) -> bool:
        """DRAIN in any form: drained, draining, or a combined state such as mixed+drain."""
        return "drain" in self.state.lower()


def parse_sinfo(text: str) -> dict[str, SlurmNode]:
    """`sinfo -h -N -o '%N|%T|%H|%E'` -> nodes by name (a node in two partitions once)."""
    nodes: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        parts = line.split("|", 3)
        if len(parts) != 4 or not parts[0]:
            continue
        name, state, stamp, reason = parts
        try:
            when = datetime.fromisoformat(stamp).timestamp()
        except ValueError:
            when = 0.0  # "Unknown": no reason set
        nodes[name] = SlurmNode(name, state, when, "" if reason == "none" else reason)
    return nodes


class SlurmNodes:
    """scontrol/sinfo for one node, every call under `remediation.slurm.timeout`."""

    def __init__(self, cfg: Config, node: str, env: Mapping[str, str] | None = None) -> None:
        sl = cfg.remediation.slurm
        self.node = sl.node_name or node.split(".")[0]
        self.timeout = sl.timeout
        self.scontrol = sl.scontrol
        bindir = os.path.dirname(sl.scontrol)
        self.sinfo = os.path.join(bindir, "sinfo") if bindir else "sinfo"
        self.env = dict(env) if env is not None else None

    def _run(self, args: list[str]) -> str:
        try:
            res = subprocess.run(
                args,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                env=self.env,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{args[0]} timed out after {self.timeout:g}s") from None
        except OSError as exc:
            raise SlurmError(f"{args[0]}: {exc.strerror or exc}") from None
        if res.returncode != 0:
            err = (res.stderr or res.stdout).strip().splitlines()
            raise SlurmError(f"{' '.join(args[:3])}: exit {res.returncode}: {err[-1:] or ''}")
        return res.stdout

    def nodes(self) -> dict[str, SlurmNode]:
        """Every node of the cluster with its state and reason."""
        return parse_sinfo(self._run([self.sinfo, "-h", "-N", "-o", _SINFO_FORMAT]))

    def drained_by_us(self, since: float, prefix: str) -> list[str]:
        """Nodes drained with a reason starting with `prefix` set at or after `since`."""
        return sorted(
            n.name
            for n in self.nodes().values()
            if n.drained and n.reason.startswith(prefix) and n.reason_time >= since
        )

    def drain(self, reason: str) -> None:
        """`scontrol update nodename=<node> state=drain reason=<reason>`."""
        self._run(
            [self.scontrol, "update", f"nodename={self.node}", "state=drain", f"reason={reason}"]
        )

    def resume(self) -> None:
        """`scontrol update nodename=<node> state=resume` (operator only)."""
        self._run([self.scontrol, "update", f"nodename={self.node}", "state=resume"])

    def this_node(self) -> SlurmNode | None:
        return self.nodes().get(self.node)
