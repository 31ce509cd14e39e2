"""Code-specific fields of an Xid report's text, all pure.

NVLink5 (Xid 144-150) unit, Fatal/Nonfatal, link, subcode and error status;
Xid 154's recovery action; Xid 13's GPC/TPC/SM; Xid 31's MMU fault; a link
number anywhere. Split from parse.py, which reads the line around them.
"""

from __future__ import annotations

import re

__all__ = ["LINK", "RECOVERY_ACTIONS", "recovery_action_name", "xid_facts"]

_GPC = re.compile(r"\(GPC (\d+), TPC (\d+), SM (\d+)\)")
_MMU = re.compile(
    r"ENGINE (\S{1,64}) (?:GPC(\d{1,4}) )?(\S{1,64}) faulted @ (\S{1,64}?)\.?"
    r" Fault is of type (\S{1,64}) (\S{1,64})"
)
_NVL5 = re.compile(
    r"\b(?P<unit>[A-Z][A-Z0-9_]{0,63})\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\s+(?:XC\d{1,4}\s+)?"
    r"(?:i\d{1,4}\s+)?Link\s+(?P<link>-?\d{1,4})\s*\((?P<regs>[^)]{0,256})\)"
)
LINK = re.compile(r"\b[Ll]ink\s*(-?\d{1,4})\b")
_R154 = re.compile(
    r"recovery action changed from (0x[0-9a-fA-F]{1,8}|\d{1,8}) \(([^)]{0,64})\)"
    r" to (0x[0-9a-fA-F]{1,8}|\d{1,8})(?: \(([^)]{0,64})\))?"
)

# Xid 154 prints "changed from 0x0 (None) to 0x2 (Node Reboot Required)". The
# number is NVML's nvmlDeviceGpuRecoveryAction_t; the words vary by driver
# ("OS Reboot", "PF FLR"), so the number decides when it is there.
RECOVERY_ACTIONS = {
    0: "None",
    1: "GPU Reset Required",
    2: "Node Reboot Required",
    3: "Drain P2P",
    4: "Drain and Reset",
}
_RECOVERY_ALIASES = {
    "none": "None",
    "gpu reset required": "GPU Reset Required",
    "gpu reset": "GPU Reset Required",
    "pf flr": "GPU Reset Required",
    "node reboot required": "Node Reboot Required",
    "node reboot": "Node Reboot Required",
    "os reboot": "Node Reboot Required",
    "drain p2p": "Drain P2P",
    "drain and reset": "Drain and Reset",
}


def recovery_action_name(value: int | None, text: str) -> str:
    """Canonical Xid 154 recovery action from the line's number and/or words."""
    if value is not None and value in RECOVERY_ACTIONS:
        return RECOVERY_ACTIONS[value]
    return _RECOVERY_ALIASES.get(text.strip().lower(), text.strip())


def _int(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def xid_facts(code: int, detail: str) -> dict[str, object]:
    """Code-specific fields: NVLink5 subcode/link/severity, 154 action, 13 GPC/TPC/SM."""
    facts: dict[str, object] = {}
    extras: list[tuple[str, str]] = []
    if 144 <= code <= 150:
        m = _NVL5.search(detail)
        if m is not None:
            facts["fatal"] = m.group("sev") == "Fatal"
            facts["link"] = int(m.group("link"))
            regs = m.group("regs").split()
            extras.append(("unit", m.group("unit")))
            try:
                facts["subcode"] = (int(regs[0], 16) >> 20) & 0x3F
                if len(regs) > 1:
                    extras.append(("error_status", regs[1]))
                extras.append(("registers", " ".join(regs)))
            except (ValueError, IndexError):
                pass
    elif code == 154:
        m = _R154.search(detail)
        if m is not None:
            before = recovery_action_name(_int(m.group(1)), m.group(2))
            facts["recovery_action"] = recovery_action_name(_int(m.group(3)), m.group(4) or "")
            extras.append(("previous_recovery_action", before))
    m13 = _GPC.search(detail) if code == 13 else None
    if m13 is not None:
        extras += [("gpc", m13.group(1)), ("tpc", m13.group(2)), ("sm", m13.group(3))]
    if code == 31:
        mm = _MMU.search(detail)
        if mm is not None:
            extras.append(("engine", mm.group(1)))
            if mm.group(2) is not None:
                extras.append(("gpc", mm.group(2)))
            extras += [
                ("client", mm.group(3)),
                ("fault_address", mm.group(4)),
                ("fault_type", mm.group(5)),
                ("access_type", mm.group(6)),
            ]
    if "link" not in facts and "ink" in detail:
        lm = LINK.search(detail)
        if lm is not None:
            facts["link"] = int(lm.group(1))
    if extras:
        facts["extras"] = tuple(extras)
    return facts
