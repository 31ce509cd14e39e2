"""Exceptions raised by gpuwatchd.

GpuwatchdError
├── ConfigError           bad configuration: file, key path, problem (exit 78)
│   └── ConfigErrors      several at once (config/problems.py)
├── CatalogError          the Xid catalog does not validate
├── SourceError           a source could not poll at all
│   ├── NvmlError         an NVML call failed; keeps NVML's error name and code
│   └── ReaderError       no kernel log reader could be opened (sources/kmsg/readers.py)
├── CallTimeout           a deadline-bounded call did not return in time (deadline.py)
├── StuckError            an earlier call for the same key is still hung (deadline.py)
├── Interrupted           a stop signal ended `diag` or `clear --resume` (cli/diag.py)
├── RasError              a job's NCCL RAS service could not be asked
├── FlightError           a PyTorch flight recorder dump could not be read
├── StoreError            the SQLite event store is unusable
├── SlurmError            scontrol failed (sinks/remediation/slurm.py)
└── KubernetesError       the API server refused or failed (sinks/remediation/kubernetes.py)

Defined beside the code that raises them: ConfigErrors, ReaderError,
SlurmError, KubernetesError, Interrupted. Two exceptions stay outside the tree on
purpose: http.request.BadRequest (the HTTP server answers it itself, it
never leaves the server) and sinks.prometheus.DroppedSampleError (strict
mode of the exposition, a programming error, hence RuntimeError).
"""

from __future__ import annotations

__all__ = [
    "CallTimeout",
    "CatalogError",
    "ConfigError",
    "FlightError",
    "GpuwatchdError",
    "NvmlError",
    "RasError",
    "SourceError",
    "StoreError",
    "StuckError",
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


class CallTimeout(GpuwatchdError):
    """The call did not return in time; it is still running in its worker."""


class StuckError(GpuwatchdError):
    """An earlier call for this key is still hung; nothing was attempted."""


class RasError(GpuwatchdError):
    """The RAS service could not be reached or answered something unexpected."""


class FlightError(GpuwatchdError):
    """A dump that could not be found, read or parsed (the reason says which)."""
