"""What a source factory may use besides the config (a module of its own, so the
sources that name it need not import the package that builds them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatchd.clock import Clock, SystemClock
from gpuwatchd.model import GpuInventory

__all__ = ["SourceContext"]


@dataclass
class SourceContext:
    """What a source factory may use besides the config."""

    clock: Clock = field(default_factory=SystemClock)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("gpuwatchd"))
    nudge: Callable[[str], None] = lambda name: None
    # Shared, read-only lookup between sources: the GPUs (and their processes) of
    # the NVML source's last published poll; a new object per poll
    gpus: Callable[[], GpuInventory] = GpuInventory
    # The last cursor the event store committed for a source (kmsg), or None
    load_cursor: Callable[[str], str | None] = lambda name: None
    # `check`: each poll reads what is there and returns; it never waits for more
    one_shot: bool = False
