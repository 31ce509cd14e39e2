"""A false-alert budget of zero: each healthy capture, replayed for an hour, alerts on nothing.

Each capture named in tests/fixtures/nvml/healthy-captures.txt, or named
`*-idle-record.json` / `*-load-record.json`, drives the daemon's own sources and
consumer chain (the NVML replay plus the fixture sysfs, Xid stage, health
engine with its `for:` durations) on a FakeClock, every source polled once a
minute for an hour, with NVML's data-link corrected-error counters rising at
the pace a healthy 2x H100 showed under DDP training (per link about 10 CRC
and 44 ECC corrections a second; a no-op for a capture without NVLinks). No
finding may open. The exposition of every poll (NVLink roll-up included), cut
to the series the rules read, then goes through the Prometheus rules with
`promtool test rules`: no alert may be pending or firing at any minute of the hour.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatchd.clock import FakeClock
from gpuwatchd.config import load_text
from gpuwatchd.pipeline import Consumers, SourceSet
from gpuwatchd.sinks.prometheus import SnapshotCollector
from gpuwatchd.sources.nvml.rollup import nvlink_rollup
from gpuwatchd.state import State

ROOT = Path(__file__).resolve().parents[2]
NVML = ROOT / "tests" / "fixtures" / "nvml"
RULES = ROOT / "deploy" / "prometheus" / "gpuwatchd-rules.yaml"
LIST = NVML / "healthy-captures.txt"
POLL = 60.0
HOUR = 3600.0
INSTANCE = {"instance": "n1:10370", "job": "gpuwatchd"}
# corrections per link per poll: 15,481 CRC and 62,825 ECC in 40 s over 2 GPUs x 18 links
LOAD = {3: round(15_481 / 40 / 36 * POLL), 4: round(62_825 / 40 / 36 * POLL)}


def healthy_captures() -> list[Path]:
    """The list file's names (comments and blank lines skipped) and the naming convention."""
    named = [
        NVML / line.split("#")[0].strip()
        for line in LIST.read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    by_name = sorted({*NVML.glob("*-idle-record.json"), *NVML.glob("*-load-record.json")})
    return list(dict.fromkeys([*named, *by_name]))


def config(tmp: Path, capture: Path) -> str:
    shm = tmp / "shm"
    shm.mkdir(exist_ok=True)
    return (
        f"daemon:\n  state_dir: {tmp}\n"
        f"paths:\n  sysfs: {ROOT / 'tests' / 'fixtures' / 'sys'}\n  dev_shm: {shm}\n"
        "sources:\n"
        f"  nvml:\n    replay: {capture}\n    interval: {POLL}\n"
        "  kmsg:\n    enabled: false\n"
        "  udev:\n    enabled: false\n"
        "  workloads:\n    enabled: false\n"
    )


def with_load(capture: Path, tmp: Path) -> Path:
    """The capture with the corrected-error counters of every link rising each poll."""
    doc = json.loads(capture.read_text())
    doc.setdefault("script", []).extend(
        {"device": "*", "call": f"nvlink_error_counter(*,{counter})", "add_per_poll": step}
        for counter, step in LOAD.items()
    )
    out = tmp / f"{capture.stem}-under-load.json"
    out.write_text(json.dumps(doc))
    return out


def replay_hour(tmp: Path, capture: Path) -> tuple[list[str], list[tuple[float, str]]]:
    """Findings that opened, and the exposition after each poll (time, text)."""
    cfg = load_text(config(tmp, capture), "config.yaml")
    clock, state = FakeClock(1_700_000_000.0), State()
    chain = Consumers(cfg, state, clock, None, ["nvml", "shm", "infiniband"])
    sources = SourceSet(cfg, state, clock)
    registry = CollectorRegistry()
    registry.register(
        SnapshotCollector(state, sources.metric_specs(True), transform=nvlink_rollup())
    )
    opened: list[str] = []
    expositions: list[tuple[float, str]] = []
    start = clock.time()
    try:
        while clock.time() - start <= HOUR:
            for source in sources.runner.sources:
                sources.runner.poll_once(source.name)
            chain.drain()
            opened += [
                f"{clock.time() - start:.0f}s {f.alertname} {dict(f.subject)} {f.reason}"
                for f in state.snapshot().findings
            ]
            expositions.append((clock.time() - start, generate_latest(registry).decode()))
            clock.advance(POLL)
    finally:
        for source in sources.runner.sources:
            close = getattr(source, "close", None)
            if callable(close):
                close()
    return sorted(set(opened)), expositions


def rule_inputs() -> set[str]:
    """The metric names the rules read."""
    return set(re.findall(r"\bgpuwatchd_[a-z0-9_]+", RULES.read_text()))


def series(expositions: list[tuple[float, str]]) -> dict[str, list[str]]:
    """promtool input series, one value a poll ('_' where a series was absent)."""
    polls = len(expositions)
    wanted = rule_inputs()
    out: dict[str, list[str]] = {}
    for i, (_, text) in enumerate(expositions):
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name, _, labels = name_labels.partition("{")
            if name not in wanted:
                continue
            extra = ",".join(f'{k}="{v}"' for k, v in INSTANCE.items())
            key = f"{name}{{{extra}{',' + labels[:-1] if labels else ''}}}"
            out.setdefault(key, ["_"] * polls)[i] = value
    out[f'up{{instance="{INSTANCE["instance"]}",job="gpuwatchd"}}'] = ["1"] * polls
    return out


def promtool_quiet(tmp: Path, expositions: list[tuple[float, str]]) -> str:
    """`promtool test rules` expecting no ALERTS sample in the hour; its output when it fails."""
    inputs = [{"series": k, "values": " ".join(v)} for k, v in series(expositions).items()]
    minutes = int(HOUR // 60)
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": f"{POLL:g}s",
                "input_series": inputs,
                "promql_expr_test": [
                    {
                        "expr": f"count_over_time(ALERTS[{minutes + 1}m])",
                        "eval_time": f"{minutes}m",
                        "exp_samples": [],
                    }
                ],
            }
        ],
    }
    path = tmp / "quiet.test.yaml"
    path.write_text(yaml.safe_dump(test))
    promtool = shutil.which("promtool")
    assert promtool is not None
    res = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    return "" if res.returncode == 0 else (res.stdout + res.stderr)[-4000:]


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize("capture", healthy_captures(), ids=lambda p: p.stem)
def test_healthy_capture_raises_no_alert_in_an_hour(tmp_path: Path, capture: Path) -> None:
    opened, expositions = replay_hour(tmp_path, with_load(capture, tmp_path))
    assert opened == []
    assert promtool_quiet(tmp_path, expositions) == ""


def test_the_list_names_real_captures() -> None:
    captures = healthy_captures()
    assert captures and all(p.is_file() for p in captures), captures
