"""Exceptions raised by gpuwatchd.

GpuwatchdError
├── ConfigError        bad configuration: file, key path, problem (exit 78)
├── CatalogError       the Xid catalog does not validate
├── SourceError        a source could not poll at all
│   └── NvmlError      an NVML call failed; keeps NVML's error name and code
└── StoreError         the SQLite event store is unusable
"""

from __future__ import annotations

__all__ = [
    "CatalogError",
    "ConfigError",
    "GpuwatchdError",
    "NvmlError",
    "SourceError",
    "StoreError",
]


class GpuwatchdError(Exception):
    """Base of every error the daemon raises on purpose."""


class ConfigError(GpuwatchdError):
    """A configuration problem, rendered as `file: key: problem` on one line."""

    def __init__(self, path: str, key: str, problem: str) -> None:
        self.path = path
        self.key = key
        self.problem = problem
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.path, self.key) if p]
        return ": ".join([*parts, self.problem])


class CatalogError(GpuwatchdError):
    """The Xid catalog is malformed."""


class SourceError(GpuwatchdError):
    """A source failed as a whole; `reason` is a short token for metrics."""

    def __init__(self, reason: str, message: str = "") -> None:
        self.reason = reason
        super().__init__(message or reason)


class NvmlError(SourceError):
    """An NVML call failed. `code` is NVML's symbolic name, e.g. NOT_SUPPORTED."""

    def __init__(self, code: str, value: int = -1, message: str = "") -> None:
        self.code = code
        self.value = value
        super().__init__(code.lower(), message or code)


class StoreError(GpuwatchdError):
    """The event store cannot be opened or written."""
