"""The start-up memory release: glibc's malloc_trim gives freed heap pages back."""

from __future__ import annotations

import platform

import pytest

from gpuwatchd.heap import release_startup_memory


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_start_up_memory_goes_back_to_the_system() -> None:
    # many small C-heap blocks (bytes objects above pymalloc's 512-byte limit), then freed
    blocks = [bytes(2048) for _ in range(20_000)]
    pin = bytes(2048)  # allocated last: glibc cannot shrink the heap past it on its own
    held = _rss_kib()
    del blocks
    assert release_startup_memory() is True
    assert _rss_kib() < held - 20_000  # most of the ~40 MiB is back (without: ~0.2 MiB)
    assert len(pin) == 2048
