"""Readings that do not change in steady state: read on a slow cadence, reused between.

On an H100 the application clocks, the ECC mode and the MIG mode (with
MIG on, also its slot count) cost about 3 ms of driver time per poll (a
fifth of a steady poll) and change only when an operator or a reset
changes them. A `StaticReads` keeps their last answers for one GPU; the
reader asks through it, and it calls NVML only when the cache was
dropped: on the source's `static_interval` (0: every poll), or at once,
on the next poll, after anything that can change them:

- the handle was dropped (a failed poll, a driver reload: a new reader);
- the set of failing calls changed (a call newly fails or answers again),
  or a call became unsupported (e.g. utilization once MIG is on);
- the GPU's reset status, recovery action or drain-and-reset field is set
  or changed (a reset is pending or just happened);
- the MIG mode has a change pending (pending != current), or says MIG is
  on while no MIG device is found;
- the source saw an Xid of the GPU or the GPU came back from unresponsive
  or lost (it asks for a refresh).

A cached call that answered nothing (an error) is not cached: the next
poll asks again. Values are reported every poll as before, so the
exposition does not change; they are only up to `static_interval` old.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpuwatchd.sources.nvml.client import FieldKey, call_key

__all__ = ["RESET_FIELDS", "STATIC_CALLS", "StaticReads"]

Get = Callable[..., object | None]

# DEVICE_CALLS names answered from the cache between refreshes
STATIC_CALLS = frozenset({"applications_clock", "ecc_mode", "max_mig_device_count", "mig_mode"})
# field values (read every poll) whose change means a reset is pending or happened
RESET_FIELDS: tuple[FieldKey, ...] = (
    ("NVML_FI_DEV_RESET_STATUS", 0),
    ("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 0),
    ("NVML_FI_DEV_DRAIN_AND_RESET_STATUS", 0),
)


class StaticReads:
    """One GPU's cached static answers; used only on that GPU's worker thread."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.refreshes = 0  # polls that read the static calls from NVML
        self._stale = True
        self._fresh = False  # this poll asks NVML (a change seen during it is already read)
        self._reset: tuple[float | None, ...] | None = None
        self._failing: frozenset[str] = frozenset()
        self._failing_now: set[str] = set()

    def begin(self, due: bool) -> bool:
        """Start a poll; drop the cache when `due` or invalidated. True when it was."""
        self._failing_now = set()
        self._fresh = due or self._stale
        if not self._fresh:
            return False
        self.values.clear()
        self._stale = False
        self.refreshes += 1
        return True

    def invalidate(self) -> None:
        """Read every static call from NVML on the next poll."""
        self._stale = True

    def get(self, get: Get, name: str, *args: int) -> object | None:
        """The cached answer of `name(*args)`, or `get`'s when there is none."""
        key = call_key(name, args)
        if key in self.values:
            return self.values[key]
        value = get(name, *args)
        if value is not None:  # an error is asked again on the next poll
            self.values[key] = value
        return value

    def failed(self, key: str, unsupported: bool) -> None:
        """A call failed this poll (`unsupported`: NVML said it never will here)."""
        if not unsupported:
            self._failing_now.add(key)
        elif not self._fresh:
            self._stale = True  # newly unsupported: the GPU's mode may have changed

    def end(self, fields: Mapping[FieldKey, float], last: Mapping[str, object]) -> None:
        """Finish a poll: invalidate when failures, reset fields or the MIG mode say so."""
        failing = frozenset(self._failing_now)
        reset = tuple(fields.get(k) for k in RESET_FIELDS)
        changed = failing != self._failing or (self._reset is not None and reset != self._reset)
        if (changed and not self._fresh) or any(reset):
            self._stale = True
        self._failing, self._reset = failing, reset
        # a MIG mode change pending, or MIG on without a MIG device: ask again next poll
        mode, devices = self.values.get("mig_mode"), last.get("mig_devices")
        if isinstance(mode, list) and len(mode) == 2:
            empty = not (isinstance(devices, list) and devices)
            if mode[0] != mode[1] or (mode[0] == 1 and empty):
                self._stale = True
