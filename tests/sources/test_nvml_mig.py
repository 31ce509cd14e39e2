"""MIG: Xid lines attributed to GPU and compute instances; MIG devices from a real capture."""

from __future__ import annotations

from gpuwatchd.sources.kmsg.parse import XID, parse_line


def test_mig_xid_line_names_its_instances() -> None:
    rec = parse_line(
        "[  200.000000] NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 43, pid=4242, "
        "name=python3, Ch 00000008"
    )
    assert rec is not None and rec.kind == XID
    assert (rec.code, rec.pci_bus_id, rec.pid, rec.process) == (43, "0000:3b:00.0", 4242, "python3")
    assert rec.extra("gpu_instance") == "1" and rec.extra("compute_instance") == "0"
    only_gi = parse_line(
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 31, pid=7, name=a.out, channel 0x0000000a"
    )
    assert only_gi is not None and only_gi.kind == XID
    assert only_gi.extra("gpu_instance") == "2" and only_gi.extra("compute_instance") == ""
    plain = parse_line("NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=x, Ch 00000008")
    assert plain is not None and plain.extra("gpu_instance") == ""
