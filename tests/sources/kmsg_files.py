"""A kernel log the kmsg source reads from a file: its config, raw /dev/kmsg records, Xid lines."""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.config import Config, KmsgConfig, PathsConfig, SourcesConfig

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "kmsg"


def kmsg_config(tmp_path: Path, kmsg_file: Path, **kmsg: object) -> Config:
    boot = tmp_path / "boot_id"
    if not boot.exists():
        boot.write_text("6b1c1a36-8d7a-4b1e-9a55-0c2f7a1d0001\n")
    procfs = tmp_path / "proc"
    procfs.mkdir(exist_ok=True)
    return Config(
        paths=PathsConfig(kmsg=str(kmsg_file), boot_id=str(boot), procfs=str(procfs)),
        sources=SourcesConfig(kmsg=KmsgConfig(backend="kmsg", **kmsg)),  # type: ignore[arg-type]
    )


def raw(seq: int, msg: str, facility: int = 0, level: int = 4, usec: int | None = None) -> str:
    return f"{facility * 8 + level},{seq},{usec if usec is not None else seq * 1000},-;{msg}\n"


def xid_line(bus: str, code: int, pid: int = 650, name: str = "python3", rest: str = "x") -> str:
    return f"NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name={name}, {rest}"
