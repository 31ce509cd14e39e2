"""Loading a config file: YAML -> the schema's dataclasses, validated; and the default file."""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

from gpuwatchd.config.schema import Config
from gpuwatchd.errors import ConfigError

__all__ = ["check_paths", "load", "load_text", "render_default", "validate_listen"]

T = TypeVar("T")


# --- loading -----------------------------------------------------------------


def load(path: str | os.PathLike[str] | None) -> Config:
    """Read and validate a config file; None means all defaults."""
    if path is None:
        return Config()
    name = str(path)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(name, "", f"cannot read: {exc.strerror or exc}") from None
    return load_text(text, name)


def load_text(text: str, name: str = "<config>") -> Config:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(name, where, f"invalid YAML: {problem}") from None
    if data is None:
        data = {}
    cfg = _build(Config, data, name, "")
    check_paths(cfg, name)
    return cfg


def _build(cls: type[T], data: object, file: str, prefix: str) -> T:
    if not isinstance(data, dict):
        raise ConfigError(file, prefix or "(top level)", f"must be a mapping, got {_tname(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(file, path, f"unknown key (known here: {known})")
        kwargs[key] = _convert(hints[key], value, file, path, fields[key].metadata)
    return cls(**kwargs)


def _convert(tp: Any, value: object, file: str, path: str, meta: Any) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, file, path)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, file, path, meta)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(file, path, f"must be a list, got {_tname(value)}")
        # A list's checks (choices, regex, filename) apply to each item.
        return [_convert(item, v, file, f"{path}[{i}]", meta) for i, v in enumerate(value)]
    if origin is dict:
        _k, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(file, path, f"must be a mapping, got {_tname(value)}")
        return {str(k): _convert(item, v, file, f"{path}.{k}", {}) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(file, path, f"must be true or false, got {_tname(value)}")
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(file, path, f"must be a number, got {_tname(value)}")
        if tp is int and not float(value).is_integer():
            raise ConfigError(file, path, "must be a whole number")
        num = tp(value)
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and num < lo:
            raise ConfigError(file, path, f"must be >= {lo}, got {num}")
        if hi is not None and num > hi:
            raise ConfigError(file, path, f"must be <= {hi}, got {num}")
        return num
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, path, f"must be a string, got {_tname(value)}")
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


def check_paths(cfg: Config, file: str) -> None:
    """Files the config names must exist and be readable (directories: exist)."""
    named = {
        "sources.nvml.replay": cfg.sources.nvml.replay,
        "http.web_config_file": cfg.http.web_config_file,
    }
    for key, value in named.items():
        if value and not os.access(value, os.R_OK):
            raise ConfigError(file, key, f"cannot read {value}")
    validate_listen(cfg, file)


def validate_listen(cfg: Config, file: str) -> None:
    host, sep, port = cfg.http.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(file, "http.listen", f"must be host:port, got {cfg.http.listen!r}")


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
