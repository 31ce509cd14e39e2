"""Site policy for the Xid tracker: per-code rules and the tracker's windows and holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatchd.config import Config

__all__ = ["Policy", "TrackerSettings"]


@dataclass(frozen=True)
class Policy:
    """Site policy for one code (defaults: raise on the first report)."""

    ignore: bool = False
    threshold: int = 1
    window: float = 0.0  # 0 = the burst window
    hold: float = -1.0  # -1 = warning_hold for warnings, 0 for info


@dataclass(frozen=True)
class TrackerSettings:
    burst_window: float = 60.0
    warning_hold: float = 600.0
    escalate_after: int = 3
    escalate_window: float = 30 * 86400.0
    policies: Mapping[tuple[str, int], Policy] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Config) -> TrackerSettings:
        x = cfg.xid
        policies: dict[tuple[str, int], Policy] = {}
        for kind, rules in (("xid", x.overrides), ("sxid", x.sxid_overrides)):
            for code, rule in rules.items():
                if code.isdigit():  # xid.from_config reports bad keys
                    policies[(kind, int(code))] = Policy(
                        rule.ignore, rule.threshold, rule.window, rule.hold
                    )
        return cls(
            x.burst_window,
            x.warning_hold,
            x.escalate_after,
            x.escalate_window_days * 86400.0,
            policies,
        )

    def policy(self, kind: str, code: int) -> Policy:
        return self.policies.get((kind, code), Policy())
