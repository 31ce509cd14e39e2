"""What `gpuwatchd diag` reads through NVML: sanity, busy GPUs, counters before and after."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatchd.diag.worker.measure import Measurement
from gpuwatchd.errors import NvmlError
from gpuwatchd.pci import normalize_bus_id
from gpuwatchd.sources.nvml.client import NvmlClient, NvmlDevice

__all__ = [
    "GpuSnapshot",
    "counter_checks",
    "foreign_pids",
    "read_gpus",
    "sanity_checks",
]

UNCORRECTED, CORRECTED, VOLATILE = 1, 0, 0  # nvmlMemoryErrorType_t, nvmlEccCounterType_t


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU as NVML saw it at one moment."""

    index: int
    name: str = ""
    temperature: float | None = None
    ecc_uncorrected: float | None = None
    ecc_corrected: float | None = None
    remapped_uncorrectable: float | None = None
    remap_pending: bool = False
    remap_failure: bool = False
    pids: tuple[int, ...] = ()
    error: str = ""
    pci_bus_id: str = ""


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _get(dev: NvmlDevice, name: str, *args: int) -> object:
    try:
        return dev.call(name, *args)
    except NvmlError:
        return None  # not supported here: the check says so, it does not fail


def _bus(pci: object) -> str:
    bus = pci.get("busId") if isinstance(pci, dict) else None
    return normalize_bus_id(bus) if isinstance(bus, str) else ""


def read_gpus(client: NvmlClient, only: Sequence[int] = ()) -> list[GpuSnapshot]:
    """A snapshot of each GPU (all, or those in `only`); unreadable ones carry `error`."""
    count = client.call("device_count")
    indices = list(only) or list(range(count if isinstance(count, int) else 0))
    out = []
    for i in indices:
        try:
            dev = client.device(i)
            name = dev.call("name")
        except NvmlError as exc:
            out.append(GpuSnapshot(i, error=f"NVML: {exc}"))
            continue
        rows = _get(dev, "remapped_rows")
        rows = rows if isinstance(rows, list) and len(rows) == 4 else [None, None, 0, 0]
        procs = _get(dev, "compute_running_processes")
        pids = tuple(
            int(p["pid"]) for p in (procs if isinstance(procs, list) else []) if isinstance(p, dict)
        )
        out.append(
            GpuSnapshot(
                i,
                str(name),
                _num(_get(dev, "temperature", 0)),
                _num(_get(dev, "total_ecc_errors", UNCORRECTED, VOLATILE)),
                _num(_get(dev, "total_ecc_errors", CORRECTED, VOLATILE)),
                _num(rows[1]),
                bool(rows[2]),
                bool(rows[3]),
                pids,
                pci_bus_id=_bus(_get(dev, "pci_info")),
            )
        )
    return out


def sanity_checks(gpus: Sequence[GpuSnapshot]) -> list[Measurement]:
    """nvml_sanity per GPU: readable, no pending or failed row remap."""
    out = []
    for g in gpus:
        problems = [g.error] if g.error else []
        if g.remap_pending:
            problems.append("row remap pending (reset the GPU)")
        if g.remap_failure:
            problems.append("row remap failed")
        detail = "; ".join(problems) or f"{g.name}, {g.temperature or 0:.0f} C"
        out.append(
            Measurement(
                "nvml_sanity",
                str(g.index),
                float(len(problems)),
                "problems",
                correct=not problems,
                detail=detail,
            )
        )
    return out


def counter_checks(
    before: Sequence[GpuSnapshot], after: Sequence[GpuSnapshot]
) -> list[Measurement]:
    """ecc_errors and row_remap: what the run added to each GPU's counters."""
    out = []
    late = {g.index: g for g in after}
    for b in before:
        a = late.get(b.index)
        gpu = str(b.index)
        if a is None or a.error or b.error:
            why = (a.error if a else "") or b.error or "GPU gone after the run"
            out.append(Measurement("ecc_errors", gpu, None, "errors", error=why))
            continue
        if b.ecc_uncorrected is None or a.ecc_uncorrected is None:
            out.append(Measurement("ecc_errors", gpu, None, "skipped", detail="ECC not reported"))
        else:
            new = a.ecc_uncorrected - b.ecc_uncorrected
            corrected = (a.ecc_corrected or 0.0) - (b.ecc_corrected or 0.0)
            out.append(
                Measurement(
                    "ecc_errors",
                    gpu,
                    new,
                    "errors",
                    correct=new == 0,
                    detail=f"{new:.0f} new uncorrectable, {corrected:.0f} corrected",
                )
            )
        new_rows = (a.remapped_uncorrectable or 0.0) - (b.remapped_uncorrectable or 0.0)
        bad = new_rows > 0 or a.remap_pending or a.remap_failure
        out.append(
            Measurement(
                "row_remap",
                gpu,
                new_rows,
                "rows",
                correct=not bad,
                detail=f"{new_rows:.0f} new rows"
                + (", remap pending" if a.remap_pending else "")
                + (", remap failed" if a.remap_failure else ""),
            )
        )
    return out


def foreign_pids(gpus: Sequence[GpuSnapshot], own_pgid: int | None) -> list[int]:
    """GPU processes that are not the diag worker's (its process group)."""
    out = []
    for g in gpus:
        for pid in g.pids:
            if pid == os.getpid():
                continue
            try:
                if own_pgid is not None and os.getpgid(pid) == own_pgid:
                    continue
            except OSError:
                pass  # not visible here (another PID namespace): someone else's
            out.append(pid)
    return sorted(set(out))
