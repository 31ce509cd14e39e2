"""The `incident` label that ties alerts of one fault together (an Xid and the hang it caused).

The Xid rule puts it on every GPU Xid alert; the hang monitor puts the same value on a
job hang it puts down to that Xid, so a router can group both (group_by: [incident]).
"""

from __future__ import annotations

__all__ = ["xid_incident"]


def xid_incident(pci_bus_id: str, code: int) -> str:
    """`xid-<bus id>-<code>`: stable while the Xid's alert is active, known to both sides."""
    return f"xid-{pci_bus_id or 'unknown'}-{code}"
