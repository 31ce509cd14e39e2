"""Median and mean of a few floats, for the slowdown detector's per-poll comparisons.

`statistics` would do, but it loads `fractions` and `decimal` (its C extension
too): 0.57 MiB of the daemon's resident memory for two one-line functions on
lists of at most a node's GPU count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["mean", "median"]


def median(values: Iterable[float]) -> float:
    """The middle value (the mean of the middle two for an even count); ValueError if none."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def mean(values: Iterable[float]) -> float:
    """The arithmetic mean, summed exactly (as statistics.fmean); ValueError if none."""
    items = list(values)
    if not items:
        raise ValueError("mean of no values")
    return math.fsum(items) / len(items)
