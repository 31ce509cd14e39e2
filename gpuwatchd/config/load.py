"""Loading a config file: YAML -> the schema's dataclasses, validated; and the default file."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from typing import Any, TypeVar, Union

from gpuwatchd.config.schema import Config
from gpuwatchd.config.validate import check_paths, raise_all, validate, validate_listen
from gpuwatchd.config.yamlfile import load_yaml
from gpuwatchd.errors import ConfigError
from gpuwatchd.logs import escape_control

__all__ = ["check_paths", "load", "load_text", "read", "render_default", "validate_listen"]

T = TypeVar("T")
# Bounds for numbers whose schema gives none: beyond them no setting makes sense
# and some would overflow (time.sleep, SQLite, C longs).
INT_LIMIT = 1 << 53
FLOAT_LIMIT = 1e9
MAX_FILE = 4 << 20  # a config file is a few KiB; refuse to parse a huge one


# --- loading -----------------------------------------------------------------


def load(path: str | os.PathLike[str] | None) -> Config:
    """Read a config file and run every check `run` runs; None means all defaults.

    Every problem is reported at once: keys that fail their type or range
    check keep their default while the other checks run.
    """
    errors: list[ConfigError] = []
    cfg = read(path, errors)
    try:
        validate(cfg, str(path) if path is not None else "<defaults>")
    except ConfigError as exc:
        errors.append(exc)
    raise_all(errors)
    return cfg


def read(path: str | os.PathLike[str] | None, errors: list[ConfigError] | None = None) -> Config:
    """Parse and type-check a config file, without machine checks.

    Problems are raised together, or appended to `errors` when given (a
    bad key then keeps its default). A file that cannot be read or parsed
    at all always raises.
    """
    if path is None:
        return Config()
    name = str(path)
    try:
        with open(name, "rb") as f:
            raw = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise ConfigError(name, "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE:
        raise ConfigError(name, "", f"larger than {MAX_FILE >> 20} MiB; not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(name, "", f"not UTF-8 (byte {exc.start})") from None
    return _parse(text, name, errors)


def load_text(text: str, name: str = "<config>") -> Config:
    """Parse and validate config text (tests, `config check` of stdin)."""
    errors: list[ConfigError] = []
    cfg = _parse(text, name, errors)
    try:
        validate(cfg, name)
    except ConfigError as exc:
        errors.append(exc)
    raise_all(errors)
    return cfg


def _parse(text: str, name: str, errors: list[ConfigError] | None) -> Config:
    if "\x00" in text:
        raise ConfigError(name, "", "contains a NUL byte")
    data = load_yaml(text, name)  # a repeated key is refused, not silently dropped
    if data is None:
        data = {}
    found: list[ConfigError] = []
    cfg = _build(Config, data, name, "", found)
    if errors is None:
        raise_all(found)
    else:
        errors.extend(found)
    return cfg


def _build(cls: type[T], data: object, file: str, prefix: str, errors: list[ConfigError]) -> T:
    """The dataclass from `data`; a bad key is recorded in `errors` and left at its default."""
    if not isinstance(data, dict):
        raise ConfigError(file, prefix or "(top level)", f"must be a mapping, got {_tname(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{_key(key)}" if prefix else _key(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            errors.append(ConfigError(file, path, f"unknown key (known here: {known})"))
            continue
        try:
            kwargs[key] = _convert(hints[key], value, file, path, fields[key].metadata, errors)
        except ConfigError as exc:
            errors.append(exc)
    return cls(**kwargs)


def _key(key: object) -> str:
    """A key as an error message shows it: control characters escaped, length bounded."""
    text = str(key) if isinstance(key, (str, int)) else repr(key)
    return escape_control(text, 64)


def _number(tp: Any, value: object, file: str, path: str, meta: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(file, path, f"must be a number, got {_tname(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(file, path, f"must be a finite number, got {value}")
    if tp is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(file, path, "must be a whole number")
    try:
        num = tp(value)
    except OverflowError:
        raise ConfigError(file, path, "too large") from None
    lo, hi = meta.get("min"), meta.get("max")
    shown = num if abs(num) < 1e30 else "a huge number"
    limit = INT_LIMIT if tp is int else FLOAT_LIMIT
    if abs(num) > limit and hi is None:
        raise ConfigError(file, path, f"too large, got {shown}")
    if lo is not None and num < lo:
        raise ConfigError(file, path, f"must be >= {lo}, got {shown}")
    if hi is not None and num > hi:
        raise ConfigError(file, path, f"must be <= {hi}, got {shown}")
    return num


def _convert(
    tp: Any, value: object, file: str, path: str, meta: Any, errors: list[ConfigError]
) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, file, path, errors)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, file, path, meta, errors)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(file, path, f"must be a list, got {_tname(value)}")
        # A list's checks (choices, regex, filename) apply to each item.
        return [_convert(item, v, file, f"{path}[{i}]", meta, errors) for i, v in enumerate(value)]
    if origin is dict:
        _k, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(file, path, f"must be a mapping, got {_tname(value)}")
        out = {}
        for k, v in value.items():
            if isinstance(k, float) or "\x00" in str(k):
                raise ConfigError(file, f"{path}.{_key(k)}", "invalid key")
            out[str(k)] = _convert(item, v, file, f"{path}.{_key(k)}", {}, errors)
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(file, path, f"must be true or false, got {_tname(value)}")
        return value
    if tp in (int, float):
        return _number(tp, value, file, path, meta)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, path, f"must be a string, got {_tname(value)}")
        if "\x00" in value:
            raise ConfigError(file, path, "contains a NUL byte")
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ConfigError(file, path, f"must be one of {', '.join(choices)}, got {value!r}")
        if meta.get("regex") and value:
            try:
                re.compile(value)
            except re.error as exc:
                raise ConfigError(file, path, f"bad regex: {exc}") from None
        if meta.get("filename") and ("/" in value or value in ("", ".", "..")):
            raise ConfigError(file, path, f"must be a file name pattern without '/', got {value!r}")
        return value
    raise ConfigError(file, path, f"unsupported type {tp!r}")  # a bug in this module


def _tname(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "mapping", list: "list", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


# --- rendering ---------------------------------------------------------------


def render_default() -> str:
    """The full default configuration as commented YAML (config.example.yaml)."""
    lines = [
        "# gpuwatchd configuration. Every key is shown with its default;",
        "# delete what you do not change. Validate with: gpuwatchd config check FILE",
        "",
    ]
    _render(Config(), 0, lines)
    return "\n".join(lines) + "\n"


def _render(obj: object, depth: int, lines: list[str]) -> None:
    import yaml

    pad = "  " * depth
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        help_text = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            if depth == 0 and lines and lines[-1] != "":
                lines.append("")
            lines.append(f"{pad}# {help_text}")
            lines.append(f"{pad}{f.name}:")
            _render(value, depth + 1, lines)
            continue
        extra = ""
        if "choices" in f.metadata:
            extra = f" ({' | '.join(f.metadata['choices'])})"
        lines.append(f"{pad}# {help_text}{extra}")
        dumped = yaml.safe_dump({f.name: value}, default_flow_style=True, width=1000).strip()
        lines.append(f"{pad}{dumped[1:-1] if dumped.startswith('{') else dumped}")
