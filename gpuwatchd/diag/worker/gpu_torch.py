"""The worker's GPU work through PyTorch (imported only by the worker process)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["TorchBackend"]

MIB = 1 << 20


class TorchBackend:
    """GEMM, copies, peer copies, memory patterns and NCCL all-reduce with torch."""

    def __init__(self) -> None:
        import torch

        self.torch: Any = torch
        self.name = f"torch {torch.__version__}"

    def device_count(self) -> int:
        """CUDA devices visible to this process."""
        return int(self.torch.cuda.device_count())

    def _sync(self, dev: int) -> None:
        self.torch.cuda.synchronize(dev)

    def gemm(self, dev: int, n: int, iters: int) -> tuple[float, float, str]:
        """(TFLOP/s, largest error relative to the reference's scale, dtype) of an n^3 GEMM."""
        torch = self.torch
        d = torch.device("cuda", dev)
        gen = torch.Generator(device=d).manual_seed(1234 + dev)
        a = torch.rand((n, n), device=d, dtype=torch.float32, generator=gen).mul_(2).sub_(1)
        b = torch.rand((n, n), device=d, dtype=torch.float32, generator=gen).mul_(2).sub_(1)
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        del a, b
        for _ in range(5):
            c = a16 @ b16
        self._sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            c = a16 @ b16
        self._sync(dev)
        seconds = time.perf_counter() - t0
        tflops = 2.0 * n**3 * iters / seconds / 1e12
        rows = torch.arange(0, n, max(1, n // 64), device=d)
        ref = (a16[rows].double().cpu()) @ (b16.double().cpu())
        got = c[rows].double().cpu()
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        return tflops, err, "bf16"

    def h2d(self, dev: int, nbytes: int, iters: int) -> float:
        """Host (pinned) to device copy, bytes per second."""
        torch = self.torch
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dev))
        dst.copy_(host, non_blocking=True)
        self._sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(host, non_blocking=True)
        self._sync(dev)
        return nbytes * iters / (time.perf_counter() - t0)

    def d2d(self, dev: int, nbytes: int, iters: int) -> float:
        """Copy within the device, bytes read plus written per second."""
        torch = self.torch
        d = torch.device("cuda", dev)
        src = torch.empty(nbytes, dtype=torch.uint8, device=d)
        dst = torch.empty_like(src)
        dst.copy_(src)
        self._sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        self._sync(dev)
        return 2.0 * nbytes * iters / (time.perf_counter() - t0)

    def p2p(self, src_dev: int, dst_dev: int, nbytes: int, iters: int) -> tuple[float, bool]:
        """(bytes per second, peer access possible) of a copy from one GPU to another."""
        torch = self.torch
        peer = bool(torch.cuda.can_device_access_peer(dst_dev, src_dev))
        src = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", src_dev))
        dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dst_dev))
        dst.copy_(src)
        self._sync(src_dev)
        self._sync(dst_dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        self._sync(src_dev)
        self._sync(dst_dev)
        return nbytes * iters / (time.perf_counter() - t0), peer

    def memory_pattern(
        self, dev: int, fraction: float, chunk_bytes: int, patterns: Sequence[int]
    ) -> tuple[int, int, float]:
        """(bytes tested, words that read back wrong, bytes written+read per second).

        Fills `fraction` of the free memory chunk by chunk with each pattern, then
        reads every chunk back, so each word holds its value for a whole pass.
        """
        torch = self.torch
        d = torch.device("cuda", dev)
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(dev)
        words = chunk_bytes // 4
        count = max(1, int(free * fraction) // chunk_bytes - 2)  # room for the compare temp
        chunks = []
        try:
            for _ in range(count):
                chunks.append(torch.empty(words, dtype=torch.int32, device=d))
        except torch.cuda.OutOfMemoryError:
            pass  # another process took memory meanwhile: test what we have
        bad = 0
        moved = 0
        t0 = time.perf_counter()
        for pattern in (*patterns, None):
            for i, chunk in enumerate(chunks):
                if pattern is None:
                    gen = torch.Generator(device=d).manual_seed(i)
                    chunk.random_(-(2**31), 2**31 - 1, generator=gen)
                else:
                    chunk.fill_(_signed(pattern))
            for i, chunk in enumerate(chunks):
                if pattern is None:
                    gen = torch.Generator(device=d).manual_seed(i)
                    want = torch.empty_like(chunk).random_(-(2**31), 2**31 - 1, generator=gen)
                    bad += int((chunk != want).sum())
                    del want
                else:
                    bad += int((chunk != _signed(pattern)).sum())
            moved += 2 * chunk_bytes * len(chunks)
        self._sync(dev)
        seconds = time.perf_counter() - t0
        tested = chunk_bytes * len(chunks)
        del chunks
        torch.cuda.empty_cache()
        return tested, bad, moved / seconds

    def all_reduce(self, devs: Sequence[int], nbytes: int, iters: int) -> tuple[float, bool]:
        """(algorithm bandwidth in bytes per second, sums right) of an NCCL all-reduce."""
        torch = self.torch
        from torch.cuda import nccl

        count = nbytes // 4
        ins = [
            torch.full((count,), float(i + 1), dtype=torch.float32, device=torch.device("cuda", d))
            for i, d in enumerate(devs)
        ]
        outs = [torch.empty_like(t) for t in ins]
        for _ in range(3):
            nccl.all_reduce(ins, outs)
        for d in devs:
            self._sync(d)
        t0 = time.perf_counter()
        for _ in range(iters):
            nccl.all_reduce(ins, outs)
        for d in devs:
            self._sync(d)
        seconds = time.perf_counter() - t0
        want = float(len(devs) * (len(devs) + 1) // 2)
        right = all(bool((o == want).all()) for o in outs)
        return nbytes * iters / seconds, right


def _signed(pattern: int) -> int:
    """A 32-bit pattern as the int32 torch stores."""
    return pattern - (1 << 32) if pattern >= 1 << 31 else pattern
