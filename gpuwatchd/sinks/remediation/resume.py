"""Undo what remediation did, for `gpuwatchd clear --resume` (an operator's act)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from gpuwatchd.config import Config
from gpuwatchd.errors import GpuwatchdError
from gpuwatchd.sinks.remediation.kubernetes import KubernetesNode
from gpuwatchd.sinks.remediation.policy import REASON_PREFIX
from gpuwatchd.sinks.remediation.sink import engaged_actions, record
from gpuwatchd.sinks.remediation.slurm import SlurmNodes
from gpuwatchd.sinks.store import EventStore

__all__ = ["resume"]

log = logging.getLogger("gpuwatchd.remediation")


def resume(
    cfg: Config,
    node: str,
    store: EventStore,
    who: str,
    reason: str = "",
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Resume the Slurm node (if we drained it), mark GpuHealthy=True and drop our taint.

    Returns one line per step taken. The `resumed` event is stored even when a
    step fails, so the daemon stops treating the actions as engaged; a step that
    failed raises after that, naming what is left to do by hand.
    """
    engaged, _ = engaged_actions(store)
    rem = cfg.remediation
    done: list[str] = []
    failed: list[str] = []
    if rem.slurm.drain_on or "slurm_drain" in engaged:
        slurm = SlurmNodes(cfg, node, env)
        try:
            current = slurm.this_node()
            if current is not None and current.drained and current.reason.startswith(REASON_PREFIX):
                slurm.resume()
                done.append(f"slurm: resumed node {slurm.node} (was: {current.reason})")
            else:
                done.append(f"slurm: node {slurm.node} not drained by gpuwatchd; left as is")
        except GpuwatchdError as exc:
            failed.append(f"slurm: {exc}")
    kube = KubernetesNode(cfg, node)
    if rem.kubernetes.condition_on or "kubernetes_condition" in engaged:
        try:
            kube.set_condition(True, "OperatorResumed", f"resumed by {who}: {reason}".strip(": "))
            done.append(f"kubernetes: {kube.node} GpuHealthy=True")
        except GpuwatchdError as exc:
            failed.append(f"kubernetes condition: {exc}")
    if rem.kubernetes.taint_on or "kubernetes_taint" in engaged:
        try:
            kube.untaint()
            done.append(f"kubernetes: {kube.node} taint removed")
        except GpuwatchdError as exc:
            failed.append(f"kubernetes taint: {exc}")
    message = "; ".join([*done, *failed]) or "nothing to resume"
    record(store, "all", "resumed", message, time.time(), who=who, reason=reason)
    log.info("remediation resumed by %s: %s", who, message)
    if failed:
        raise GpuwatchdError("resume incomplete: " + "; ".join(failed))
    return done
