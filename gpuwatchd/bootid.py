"""This boot's id: kernel-log cursors and stored events are tied to it."""

from __future__ import annotations

__all__ = ["read_boot_id"]


def read_boot_id(path: str) -> str:
    """This boot's id, or "unknown" (cursors then never match across runs)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"
