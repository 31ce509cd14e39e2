"""Opt-in remediation settings: Slurm drain, Kubernetes node condition and taint."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.config.fields import opt, section

__all__ = ["KubernetesRemediationConfig", "RemediationConfig", "SlurmRemediationConfig"]


@dataclass(frozen=True)
class SlurmRemediationConfig:
    drain_on: list[str] = opt(
        [],
        "severities that drain this node in Slurm (only critical can; empty = never)",
        choices=("critical",),
    )
    node_name: str = opt("", "Slurm NodeName; empty = daemon.node_name, short form")
    scontrol: str = opt("scontrol", "scontrol to run (sinfo is taken from the same directory)")
    timeout: float = opt(10.0, "seconds one scontrol or sinfo call may take", min=1, max=120)
    max_drains: int = opt(
        3,
        "fleet-wide guard: no drain while this many other nodes were drained by gpuwatchd"
        " (read from Slurm) within guard_window_seconds",
        min=1,
    )
    guard_window_seconds: float = opt(
        3600.0, "the guard's window (by the time Slurm set the reason)", min=60, max=604800
    )
    spread_seconds: float = opt(
        30.0,
        "wait up to this much longer than hold_seconds, a fixed share per node name, so daemons"
        " that see one fault at once consult the guard one after another",
        min=0,
        max=3600,
    )


@dataclass(frozen=True)
class KubernetesRemediationConfig:
    condition_on: list[str] = opt(
        [],
        "severities that set the node condition GpuHealthy=False (only critical can)",
        choices=("critical",),
    )
    taint_on: list[str] = opt(
        [],
        "severities that add the taint gpuwatchd.io/gpu-unhealthy:NoSchedule (only critical)",
        choices=("critical",),
    )
    node_name: str = opt("", "Kubernetes node name; empty = daemon.node_name")
    problem_condition: str = opt(
        "",
        "also write this condition type, status True while GpuHealthy is False (for tools"
        " such as draino that act on conditions that are True); empty = none",
    )
    api_url: str = opt("", "API server URL; empty = in-cluster, the pod's service account")
    token_file: str = opt("", "bearer token file used with api_url")
    ca_file: str = opt("", "CA bundle used with an https api_url")
    timeout: float = opt(10.0, "seconds one API call may take", min=1, max=120)


@dataclass(frozen=True)
class RemediationConfig:
    hold_seconds: float = opt(
        300.0, "a critical condition must hold this long before any action", min=0, max=86400
    )
    alerts: list[str] = opt([], "alert names that may act; empty = every critical alert")
    slurm: SlurmRemediationConfig = section(SlurmRemediationConfig, "Slurm drain (opt-in)")
    kubernetes: KubernetesRemediationConfig = section(
        KubernetesRemediationConfig, "Kubernetes node condition and taint (opt-in)"
    )
