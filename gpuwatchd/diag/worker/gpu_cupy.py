"""The worker's GPU work through CuPy and its NCCL binding (worker process only)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["CupyBackend"]

H2D, D2D = 1, 3  # cudaMemcpyKind

# A per-word hash of the index, so the "address" pattern needs no second buffer to check.
_HASH = (
    "unsigned int v = ((unsigned int)i) ^ seed; v = (v ^ 61u) ^ (v >> 16); v *= 9u;"
    " v ^= v >> 4; v *= 0x27d4eb2du; v ^= v >> 15;"
)


class CupyBackend:
    """GEMM, copies, peer copies, memory patterns and NCCL all-reduce with CuPy."""

    def __init__(self) -> None:
        import cupy

        self.cp: Any = cupy
        self.rt: Any = cupy.cuda.runtime
        self.name = f"cupy {cupy.__version__}"
        self._fill_hash = cupy.ElementwiseKernel(
            "uint32 seed", "uint32 x", _HASH + " x = v;", "gpuwatchd_fill_hash"
        )
        self._bad_hash = cupy.ElementwiseKernel(
            "uint32 x, uint32 seed",
            "bool bad",
            _HASH + " bad = x != v;",
            "gpuwatchd_bad_hash",
        )

    def device_count(self) -> int:
        """CUDA devices visible to this process."""
        return int(self.rt.getDeviceCount())

    def _sync(self, dev: int) -> None:
        with self.cp.cuda.Device(dev):
            self.cp.cuda.Device(dev).synchronize()

    def gemm(self, dev: int, n: int, iters: int) -> tuple[float, float, str]:
        """(TFLOP/s, largest error relative to the reference's scale, dtype) of an n^3 GEMM."""
        cp = self.cp
        import numpy as np

        with cp.cuda.Device(dev):
            rng = cp.random.default_rng(1234 + dev)
            a = (rng.random((n, n), dtype=cp.float32) * 2 - 1).astype(cp.float16)
            b = (rng.random((n, n), dtype=cp.float32) * 2 - 1).astype(cp.float16)
            for _ in range(5):
                c = a @ b
            self._sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                c = a @ b
            self._sync(dev)
            seconds = time.perf_counter() - t0
            rows = cp.arange(0, n, max(1, n // 64))
            ref = cp.asnumpy(a[rows]).astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
            got = cp.asnumpy(c[rows]).astype(np.float64)
        err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))
        return 2.0 * n**3 * iters / seconds / 1e12, err, "fp16"

    def h2d(self, dev: int, nbytes: int, iters: int) -> float:
        """Host (pinned) to device copy, bytes per second."""
        cp = self.cp
        with cp.cuda.Device(dev):
            host = cp.cuda.alloc_pinned_memory(nbytes)
            dst = cp.cuda.alloc(nbytes)
            self.rt.memcpyAsync(dst.ptr, host.ptr, nbytes, H2D, 0)
            self._sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                self.rt.memcpyAsync(dst.ptr, host.ptr, nbytes, H2D, 0)
            self._sync(dev)
            return nbytes * iters / (time.perf_counter() - t0)

    def d2d(self, dev: int, nbytes: int, iters: int) -> float:
        """Copy within the device, bytes read plus written per second."""
        cp = self.cp
        with cp.cuda.Device(dev):
            src, dst = cp.cuda.alloc(nbytes), cp.cuda.alloc(nbytes)
            self.rt.memcpyAsync(dst.ptr, src.ptr, nbytes, D2D, 0)
            self._sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                self.rt.memcpyAsync(dst.ptr, src.ptr, nbytes, D2D, 0)
            self._sync(dev)
            return 2.0 * nbytes * iters / (time.perf_counter() - t0)

    def p2p(self, src_dev: int, dst_dev: int, nbytes: int, iters: int) -> tuple[float, bool]:
        """(bytes per second, peer access possible) of a copy from one GPU to another."""
        cp = self.cp
        peer = bool(self.rt.deviceCanAccessPeer(dst_dev, src_dev))
        if peer:
            with cp.cuda.Device(dst_dev):
                try:
                    self.rt.deviceEnablePeerAccess(src_dev)
                except cp.cuda.runtime.CUDARuntimeError:
                    pass  # already enabled by an earlier pair
        with cp.cuda.Device(src_dev):
            src = cp.cuda.alloc(nbytes)
        with cp.cuda.Device(dst_dev):
            dst = cp.cuda.alloc(nbytes)
            self.rt.memcpyPeerAsync(dst.ptr, dst_dev, src.ptr, src_dev, nbytes, 0)
            self._sync(dst_dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                self.rt.memcpyPeerAsync(dst.ptr, dst_dev, src.ptr, src_dev, nbytes, 0)
            self._sync(dst_dev)
            return nbytes * iters / (time.perf_counter() - t0), peer

    def memory_pattern(
        self, dev: int, fraction: float, chunk_bytes: int, patterns: Sequence[int]
    ) -> tuple[int, int, float]:
        """(bytes tested, words that read back wrong, bytes written+read per second)."""
        cp = self.cp
        with cp.cuda.Device(dev):
            pool = cp.get_default_memory_pool()
            pool.free_all_blocks()
            free, _total = self.rt.memGetInfo()
            words = chunk_bytes // 4
            count = max(1, int(free * fraction) // chunk_bytes - 2)
            chunks = []
            try:
                for _ in range(count):
                    chunks.append(cp.empty(words, dtype=cp.uint32))
            except cp.cuda.memory.OutOfMemoryError:
                pass  # another process took memory meanwhile: test what we have
            bad = 0
            moved = 0
            t0 = time.perf_counter()
            for pattern in (*patterns, None):
                for i, chunk in enumerate(chunks):
                    if pattern is None:
                        self._fill_hash(cp.uint32(i), chunk)
                    else:
                        chunk.fill(pattern)
                for i, chunk in enumerate(chunks):
                    if pattern is None:
                        flags = self._bad_hash(chunk, cp.uint32(i))
                    else:
                        flags = chunk != cp.uint32(pattern)
                    bad += int(cp.count_nonzero(flags))
                    del flags
                moved += 2 * chunk_bytes * len(chunks)
            self._sync(dev)
            seconds = time.perf_counter() - t0
            tested = chunk_bytes * len(chunks)
            del chunks
            pool.free_all_blocks()
        return tested, bad, moved / seconds

    def all_reduce(self, devs: Sequence[int], nbytes: int, iters: int) -> tuple[float, bool]:
        """(algorithm bandwidth in bytes per second, sums right) of an NCCL all-reduce."""
        cp = self.cp
        from cupy.cuda import nccl

        count = nbytes // 4
        comms = nccl.NcclCommunicator.initAll(list(devs))
        ins, outs = [], []
        for i, d in enumerate(devs):
            with cp.cuda.Device(d):
                ins.append(cp.full((count,), float(i + 1), dtype=cp.float32))
                outs.append(cp.empty((count,), dtype=cp.float32))

        def once() -> None:
            nccl.groupStart()
            for comm, d, x, y in zip(comms, devs, ins, outs, strict=True):
                with cp.cuda.Device(d):
                    comm.allReduce(
                        x.data.ptr, y.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0
                    )
            nccl.groupEnd()

        for _ in range(3):
            once()
        for d in devs:
            self._sync(d)
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        for d in devs:
            self._sync(d)
        seconds = time.perf_counter() - t0
        want = float(len(devs) * (len(devs) + 1) // 2)
        right = True
        for d, y in zip(devs, outs, strict=True):
            with cp.cuda.Device(d):
                right = right and bool((y == want).all())
        for comm in comms:
            comm.destroy()
        return nbytes * iters / seconds, right
