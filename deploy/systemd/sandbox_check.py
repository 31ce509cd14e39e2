#!/usr/bin/env python3
"""Check that NVML works under gpuwatchd.service's seccomp settings, on this node.

Runs `gpuwatchd record` twice, once as is and once under what the unit asks
systemd for:

    SystemCallFilter=@system-service, then ~@privileged @resources (EPERM)
    MemoryDenyWriteExecute=yes
    NoNewPrivileges=yes

reproduced with libseccomp (no systemd needed), and compares the outcome of
every NVML call. Run it after a driver upgrade, with the venv's Python:

    /opt/gpuwatchd/bin/python deploy/systemd/sandbox_check.py

Exit status 0: identical outcomes. 1: something differs (the differences are
printed; relax the unit with a drop-in). 2: the check could not run.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import runpy
import subprocess
import sys
import tempfile
from typing import Any

ALLOW = 0x7FFF0000
EPERM = 0x00050000 | 1
MASKED_EQ = 7  # enum scmp_compare: SCMP_CMP_MASKED_EQ
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000


class _Cmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _libseccomp() -> Any:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_Cmp)
    ]  # fmt: skip
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def syscall_group(group: str) -> set[str]:
    """Expand a systemd syscall group (@name) with systemd-analyze, recursively."""
    out = subprocess.run(
        ["systemd-analyze", "syscall-filter", group], capture_output=True, text=True, check=True
    ).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            names |= syscall_group(item) if item.startswith("@") else {item}
    return names


def allowed_syscalls() -> set[str]:
    """The unit's allow-list: @system-service minus @privileged and @resources."""
    return (
        syscall_group("@system-service")
        - syscall_group("@privileged")
        - syscall_group("@resources")
    )


def install(allowed: set[str], mdwe: bool = True) -> None:
    """Load the filters into this process (and its future children)."""
    lib = _libseccomp()
    if mdwe:
        # Loaded first: adding a second filter needs seccomp(2), which the allow-list lacks.
        ctx = lib.seccomp_init(ALLOW)
        for name, arg, mask in (
            ("mmap", 2, PROT_WRITE | PROT_EXEC),
            ("mprotect", 2, PROT_EXEC),
            ("pkey_mprotect", 2, PROT_EXEC),
            ("shmat", 2, SHM_EXEC),
        ):
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr >= 0:
                cmp = (_Cmp * 1)(_Cmp(arg, MASKED_EQ, mask, mask))
                if lib.seccomp_rule_add_array(ctx, EPERM, nr, 1, cmp) != 0:
                    raise OSError(f"seccomp rule for {name}")
        if lib.seccomp_load(ctx) != 0:
            raise OSError("loading the MemoryDenyWriteExecute filter failed")
    ctx = lib.seccomp_init(EPERM)
    for name in sorted(allowed):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr >= 0 and lib.seccomp_rule_add_array(ctx, ALLOW, nr, 0, None) != 0:
            raise OSError(f"seccomp rule for {name}")
    if lib.seccomp_load(ctx) != 0:
        raise OSError("loading the system call filter failed")


def outcomes(capture: dict[str, Any]) -> dict[str, str]:
    """call path -> "ok" or the NVML error name, for every recorded call."""
    out: dict[str, str] = {"init": str(capture.get("summary", {}).get("init_error"))}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "us" in node and ("value" in node or "error" in node):
                out[path] = str(node.get("error") or "ok")
                return
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(capture.get("devices", []), "")
    return out


def record(out: str, sandbox: bool, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", out, *extra]
    if sandbox:
        cmd.append("--sandbox")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if res.returncode not in (0, 1) or not os.path.exists(out):
        raise RuntimeError(f"record failed ({res.returncode}): {res.stderr[-2000:]}")
    with open(out, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-replay", metavar="FILE", help="check a replayed capture (tests)")
    parser.add_argument(
        "--syscalls",
        metavar="FILE",
        help="allow-list, one name a line (default: expand the unit's groups with systemd-analyze)",
    )
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--sandbox", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    replay = ["--from-replay", args.from_replay] if args.from_replay else []
    if args.child:
        if args.sandbox:
            if args.syscalls:
                with open(args.syscalls, encoding="ascii") as f:
                    install(set(f.read().split()))
            else:
                install(allowed_syscalls())
        sys.argv = ["gpuwatchd.cli.record", "--out", args.child]
        sys.argv += ["--polls", "2", "--interval", "0.5"]
        sys.argv += replay
        runpy.run_module("gpuwatchd.cli.record", run_name="__main__")  # exits with record's status
        return 0
    extra = replay + (["--syscalls", os.path.abspath(args.syscalls)] if args.syscalls else [])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            plain = outcomes(record(os.path.join(tmp, "plain.json"), False, extra))
            boxed = outcomes(record(os.path.join(tmp, "boxed.json"), True, extra))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"sandbox check could not run: {exc}", file=sys.stderr)
        return 2
    diff = {k: (plain.get(k), boxed.get(k)) for k in plain.keys() | boxed.keys()
            if plain.get(k) != boxed.get(k)}  # fmt: skip
    for key, (a, b) in sorted(diff.items()):
        print(f"{key}: unsandboxed {a}, sandboxed {b}")
    print(f"{len(plain)} NVML call outcomes compared, {len(diff)} differ")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
