"""The health rules the engine runs: one explicit list, as the sources registry is.

Importing this module is what gives an engine its rules; nothing registers
itself on import. Each entry may say when time alone can next change its
answer (`due`): on a quiet node (nothing open or pending, no new snapshot)
the engine skips its tick until the earliest of those. A rule without `due`
changes its answer only with new input (a new snapshot, an Xid stage
sample) or only fades with time (rates over the window, hold times).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwatchd.config import Config
from gpuwatchd.health import fabric, rules, storage
from gpuwatchd.health.diag import rule as diag_rule
from gpuwatchd.health.history import History
from gpuwatchd.health.rules import Inputs, Rule
from gpuwatchd.model import Finding
from gpuwatchd.state import NodeSnapshot

__all__ = ["MAX_QUIET_SECONDS", "RULES", "RuleSpec", "evaluate", "next_change"]

# The engine evaluates at least this often even when every rule says it can wait.
MAX_QUIET_SECONDS = 60.0

Due = Callable[[NodeSnapshot, History, Config], float]


@dataclass(frozen=True)
class RuleSpec:
    """A rule, its name (the rule_errors label) and when time alone can next change it."""

    name: str
    rule: Rule
    due: Due | None = None


RULES: tuple[RuleSpec, ...] = (
    RuleSpec("xid", rules.xid),
    RuleSpec("ecc_uncorrectable", rules.ecc_uncorrectable),
    RuleSpec("row_remap", rules.row_remap),
    RuleSpec("nvlink", rules.nvlink),
    RuleSpec("thermal", rules.thermal),
    RuleSpec("pcie", rules.pcie),
    RuleSpec("recovery_action", rules.recovery_action),
    RuleSpec("gpu_presence", rules.gpu_presence, rules.presence_due),
    RuleSpec("collectors", rules.collectors, rules.collectors_due),
    RuleSpec("fabric", fabric.fabric),
    RuleSpec("state_dir", storage.state_dir),
    RuleSpec("diag_failed", diag_rule.diag_failed),
)


def next_change(
    snapshot: NodeSnapshot, history: History, cfg: Config, specs: Sequence[RuleSpec] = RULES
) -> float:
    """The earliest wall time a time-based finding can appear without new input."""
    return min((s.due(snapshot, history, cfg) for s in specs if s.due), default=float("inf"))


def evaluate(inp: Inputs, specs: Sequence[RuleSpec] = RULES) -> list[Finding]:
    """Run every rule; findings of disabled alert names are dropped."""
    disabled = set(inp.cfg.health.disabled_rules)
    return [f for s in specs for f in s.rule(inp) if f.alertname not in disabled]
