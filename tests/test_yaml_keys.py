"""One YAML loader for every file the project reads: a key given twice is an error naming the
file, the key path and both lines (PyYAML alone keeps the last value and says nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.config.validate import ConfigErrors
from gpuwatchd.config.yamlfile import load_yaml
from gpuwatchd.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / "gpuwatchd" / "data"


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        ("http:\n  listen: a\nhttp:\n  listen: b\n", "http", "lines 1 and 3"),
        ("a:\n  b: 1\n  c: 2\n  b: 3\n", "a.b", "lines 2 and 4"),
        ("a: {b: 1, b: 2}\n", "a.b", "lines 1 and 1"),
        ("l:\n  - x: 1\n    x: 2\n", "l[0].x", "lines 2 and 3"),
        ("true: 1\nyes: 2\n", "True", "lines 1 and 2"),  # one key to YAML 1.1
        ("2: a\n0x2: b\n", "2", "lines 1 and 2"),
    ],
)
def test_a_repeated_key_names_file_path_and_lines(text: str, key: str, lines: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_yaml(text, "f.yaml")
    assert (exc.value.path, exc.value.key) == ("f.yaml", key)
    assert lines in exc.value.problem


def test_every_repeated_key_is_reported_at_once() -> None:
    with pytest.raises(ConfigErrors) as exc:
        load_yaml("a: 1\nb: 1\na: 2\nb: 2\n", "f.yaml")
    assert [e.key for e in exc.value.errors] == ["a", "b"]


def test_what_is_not_a_repeat_loads() -> None:
    text = "base: &b {x: 1, y: 2}\nder:\n  <<: *b\n  x: 3\nl: [{k: 1}, {k: 2}]\nq: *b\n"
    assert load_yaml(text, "f.yaml") == {
        "base": {"x": 1, "y": 2},
        "der": {"x": 3, "y": 2},  # a merge key, then an override: YAML's own way
        "l": [{"k": 1}, {"k": 2}],
        "q": {"x": 1, "y": 2},
    }
    assert load_yaml("", "f.yaml") is None
    assert load_yaml(b"a: 1\n", "f.yaml") == {"a": 1}


def test_invalid_yaml_names_the_line() -> None:
    with pytest.raises(ConfigError) as exc:
        load_yaml("a: [\n", "f.yaml")
    assert (exc.value.key, exc.value.problem.split(":")[0]) == ("line 2", "invalid YAML")


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.yaml")))
def test_shipped_yaml_has_no_repeated_key(name: str) -> None:
    load_yaml((DATA / name).read_bytes(), name)
