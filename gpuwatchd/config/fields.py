"""The two helpers every config dataclass uses: `opt` (a field) and `section` (a sub-table)."""

from __future__ import annotations

from dataclasses import field
from typing import Any, TypeVar

__all__ = ["opt", "section"]

T = TypeVar("T")


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field with a default and a one-line help text."""
    if isinstance(default, (list, dict)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **meta}
        )
    return field(default=default, metadata={"help": help, **meta})


def section(cls: type[T], help: str) -> Any:
    """A nested section: a dataclass built with its own defaults."""
    return field(default_factory=cls, metadata={"help": help})
