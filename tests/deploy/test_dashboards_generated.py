"""deploy/grafana/*.json are what scripts/gen_dashboards.py generates (grafana-foundation-sdk)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk")

ROOT = Path(__file__).resolve().parents[2]


def test_dashboards_are_generated_and_current() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_notices_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_dashboards

    monkeypatch.setattr(gen_dashboards, "OUT", tmp_path)
    monkeypatch.setattr(gen_dashboards, "CHART_COPY", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gen_dashboards.py", "--check"])
    assert gen_dashboards.main() == 1
    monkeypatch.setattr(sys, "argv", ["gen_dashboards.py"])
    assert gen_dashboards.main() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpuwatchd-fleet.json",
        "gpuwatchd-node.json",
    ]
    monkeypatch.setattr(sys, "argv", ["gen_dashboards.py", "--check"])
    assert gen_dashboards.main() == 0
