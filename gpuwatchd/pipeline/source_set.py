"""The enabled sources and the runner that polls them, built from one config."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuwatchd.clock import Clock
from gpuwatchd.config import Config
from gpuwatchd.model import GpuInventory, MetricSpec
from gpuwatchd.sources import SourceContext, all_metrics, build_sources
from gpuwatchd.sources.runner import Runner
from gpuwatchd.state import State

if TYPE_CHECKING:
    from gpuwatchd.pipeline.daemon import Pipeline

__all__ = ["SourceSet"]


class SourceSet:
    """The enabled sources and the runner that polls them, built from one config."""

    def __init__(
        self,
        cfg: Config,
        state: State,
        clock: Clock,
        pipeline: Pipeline | None = None,
        one_shot: bool = False,
    ) -> None:
        """`pipeline` None: sources start from scratch (no stored cursor), as `check` does;
        `one_shot`: a poll never waits for input that is not there yet (`check`)."""
        self.cfg = cfg
        self.state = state
        self.clock = clock
        ctx = SourceContext(
            clock=clock,
            log=logging.getLogger("gpuwatchd.sources"),
            nudge=self._nudge,
            gpus=self.gpus,
            load_cursor=pipeline.load_cursor if pipeline else (lambda name: None),
            one_shot=one_shot,
        )
        self.sources = build_sources(cfg, ctx)
        self.runner = Runner(self.sources, state, clock)

    def _nudge(self, name: str) -> None:
        self.runner.nudge(name)

    def gpus(self) -> GpuInventory:
        """The GPUs of the NVML source's last published poll (empty before it)."""
        nvml = self.state.snapshot().sources.get("nvml")
        inventory = nvml.inventory if nvml is not None else None
        return inventory if inventory is not None else GpuInventory()

    @staticmethod
    def metric_specs(with_consumers: bool) -> list[MetricSpec]:
        if not with_consumers:
            return list(all_metrics())
        from gpuwatchd.pipeline.daemon import CONSUMER_METRICS  # late: the sinks' metrics

        return [*all_metrics(), *CONSUMER_METRICS]

    def start(self, stopping: Callable[[], bool] = bool) -> None:
        wait = 2 * self.cfg.sources.nvml.call_timeout + 1  # NVML's init, then one call each
        self.runner.start(first=("nvml",), first_timeout=wait, stopping=stopping)

    def stop(self) -> None:
        self.runner.stop()
