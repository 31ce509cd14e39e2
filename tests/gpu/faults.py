"""A real GPU fault for the device scripts: one CUDA thread storing to an unmapped address.

The kernel is PTX handed to the driver API through ctypes, so no CUDA toolkit
or Python GPU package is needed: the driver JIT-compiles it. The driver then
logs Xid 31 (MMU fault) for the calling process.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

UNMAPPED = 0x7F_0000_0000  # nothing is mapped here in a fresh CUDA context

PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry scribble(.param .u64 where)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<2>;
    ld.param.u64 %rd1, [where];
    mov.u32 %r1, 31;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


def illegal_write_ptx(ordinal: int = 0) -> dict[str, Any]:
    """Fault CUDA device `ordinal`; returns the CUresults, its bus id, launch times and pid."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def ok(name: str, *args: Any) -> None:
        rc = int(getattr(cuda, name)(*args))
        if rc != 0:
            raise RuntimeError(f"{name} returned CUresult {rc}")

    ok("cuInit", 0)
    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    ok("cuDeviceGet", ctypes.byref(dev), ordinal)
    ok("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
    ok("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(PTX))
    ok("cuModuleGetFunction", ctypes.byref(fn), mod, b"scribble")
    buf = ctypes.create_string_buffer(64)
    cuda.cuDeviceGetPCIBusId(buf, 64, dev)
    where = ctypes.c_uint64(UNMAPPED)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(where), ctypes.c_void_p))
    launched_at, launched_mono = time.time(), time.monotonic()
    launch = int(cuda.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None))
    sync = int(cuda.cuCtxSynchronize())
    return {
        "bus": buf.value.decode(),
        "launch": launch,
        "synchronize": sync,  # 700 = CUDA_ERROR_ILLEGAL_ADDRESS
        "launched_at": launched_at,
        "launched_mono": launched_mono,
        "pid": os.getpid(),
    }
