"""Give the start-up's transient memory back to the system once the daemon serves.

Loading the config, the Xid catalog, the hang signatures and the first polls leaves
freed blocks in the C heap that glibc keeps mapped; `malloc_trim(0)` returns the free
pages to the kernel. Where the C library has no such call (musl, other systems) this
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

__all__ = ["release_startup_memory"]

log = logging.getLogger("gpuwatchd")


def release_startup_memory() -> bool:
    """Collect garbage and trim the C heap; True when the heap was trimmed."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    released = bool(trim(0))
    log.debug("start-up memory released (malloc_trim: %s)", released)
    return released
