"""Fuzz the config loader: any text is a Config or a ConfigError, never another exception.

Seeds: config.example.yaml and the files kept in tests/fuzz/corpus/config.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd import config
from gpuwatchd.config import Config
from gpuwatchd.errors import ConfigError
from tests.conftest import ROOT

CORPUS = Path(__file__).parent / "corpus" / "config"
SEEDS = [p.read_text() for p in sorted(CORPUS.iterdir())] + [
    (ROOT / "config.example.yaml").read_text()
]
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KEYS = [
    "sources", "nvml", "interval", "call_timeout", "kmsg", "backend", "file", "daemon",
    "state_dir", "alertmanager", "urls", "static_labels", "xid", "overrides", "severity",
    "store", "max_events", "http", "listen", "health", "warning_hold",
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["http://a:b@h:1", "am:9093", "\x00", "127.0.0.1:99999", "critical"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(KEYS) | st.text(max_size=6) | st.integers(), inner, max_size=5
        )
    ),
    max_leaves=20,
)


def load(text: str) -> None:
    try:
        cfg = config.load_text(text, "fuzz.yaml")
    except ConfigError as exc:
        for line in str(exc).splitlines():
            assert line.startswith("fuzz.yaml"), line
        return
    assert isinstance(cfg, Config)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=6))
def test_any_structure_is_a_config_or_a_config_error(data: dict[object, object]) -> None:
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except yaml.YAMLError:
        return
    load(text)


@FUZZ
@given(st.sampled_from(SEEDS), st.integers(0, 2000), st.text(max_size=30))
def test_any_mutated_file_is_a_config_or_a_config_error(seed: str, at: int, junk: str) -> None:
    load(seed[:at] + junk + seed[at:])


def test_every_corpus_file_loads_or_fails_cleanly() -> None:
    for text in SEEDS:
        load(text)
