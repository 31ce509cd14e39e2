"""docs/metrics.md lists every exported metric; it is generated and must not be stale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def generator() -> ModuleType:
    path = ROOT / "scripts" / "gen_metrics_doc.py"
    spec = importlib.util.spec_from_file_location("gen_metrics_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_metrics_doc", module)
    spec.loader.exec_module(module)
    return module


def test_metrics_doc_is_up_to_date() -> None:
    gen = generator()
    doc = ROOT / "docs" / "metrics.md"
    assert doc.exists(), "docs/metrics.md missing: run python scripts/gen_metrics_doc.py"
    assert doc.read_text() == gen.render(), (
        "docs/metrics.md is stale: run python scripts/gen_metrics_doc.py"
    )


def test_every_metric_of_every_producer_is_in_the_table() -> None:
    gen = generator()
    text = gen.render()
    specs = [spec for _, spec in gen.collect()]
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        assert f"| `{spec.name}` | {spec.type} |" in text
    names = {s.name for s in specs}
    # one family from each kind of producer, so a dropped producer is noticed
    for name in (
        "gpuwatchd_gpu_power_watts",
        "gpuwatchd_shm_segments",
        "gpuwatchd_infiniband_state_id",
        "gpuwatchd_udev_monitor_up",
        "gpuwatchd_collector_success",
        "gpuwatchd_health",
        "gpuwatchd_alertmanager_queue_length",
    ):
        assert name in names


def test_dcgm_column_maps_known_fields() -> None:
    text = generator().render()
    row = next(line for line in text.splitlines() if "`gpuwatchd_gpu_power_watts`" in line)
    assert row.endswith("| DCGM_FI_DEV_POWER_USAGE |")
    row = next(line for line in text.splitlines() if "`gpuwatchd_xid_errors_total`" in line)
    assert "DCGM_FI_DEV_XID_ERRORS" in row
