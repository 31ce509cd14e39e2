"""Fabric alerts: a GPU not registered with its NVLink fabric, the fabric manager down."""

from __future__ import annotations

from gpuwatchd.config import Config
from gpuwatchd.health import ruleset
from gpuwatchd.health.history import History, View
from gpuwatchd.health.rules import Inputs
from gpuwatchd.model import Finding, Sample
from tests.health.snapshots import GPU0, GPU1, T0, Node


def evaluate(*samples: Sample) -> list[Finding]:
    node = Node(extra_sources={"fabric": list(samples)})
    cfg = Config()
    view = View(node.snapshot(T0))
    history = History(cfg.health.rate_window_seconds)
    history.observe(view, T0)
    return [
        f
        for f in ruleset.evaluate(Inputs(view, history, cfg, T0, ()))
        if f.alertname in ("GpuFabricNotRegistered", "FabricManagerDown")
    ]


def state(gpu: dict[str, str], value: float) -> Sample:
    return Sample.of("gpuwatchd_gpu_fabric_state", value, **gpu)


def info(gpu: dict[str, str], status: str) -> Sample:
    return Sample.of(
        "gpuwatchd_gpu_fabric_info",
        1,
        **gpu,
        state="completed",
        status=status,
        clique_id="0",
        cluster_uuid="",
    )


def test_registered_gpus_and_a_running_manager_are_quiet() -> None:
    up = Sample.of("gpuwatchd_fabricmanager_up", 1)
    assert evaluate(state(GPU0, 3), state(GPU1, 3), info(GPU0, "success"), up) == []


def test_unregistered_gpu_is_critical() -> None:
    found = evaluate(state(GPU0, 3), state(GPU1, 2))
    assert [(f.alertname, dict(f.subject)["gpu"], f.reason) for f in found] == [
        ("GpuFabricNotRegistered", "1", "fabric state in progress")
    ]
    assert str(found[0].severity) == "critical"


def test_failed_registration_counts_even_when_completed() -> None:
    found = evaluate(state(GPU0, 3), info(GPU0, "nvml_error_15"))
    assert [f.reason for f in found] == ["fabric registration failed: nvml_error_15"]


def test_manager_down_only_where_gpus_have_a_fabric() -> None:
    down = Sample.of("gpuwatchd_fabricmanager_up", 0)
    failed = Sample.of(
        "gpuwatchd_fabricmanager_state_info",
        1,
        active_state="failed",
        sub_state="failed",
        result="exit-code",
    )
    found = evaluate(state(GPU0, 3), down, failed)
    assert [(f.alertname, f.scope, f.reason) for f in found] == [
        (
            "FabricManagerDown",
            "node",
            "nvidia-fabricmanager is failed on a node whose GPUs are on a fabric",
        )
    ]
    assert evaluate(down, failed) == []  # no fabric state: a PCIe or single-GPU node
