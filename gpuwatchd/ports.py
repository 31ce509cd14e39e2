"""The InfiniBand port contract between the source that reads sysfs and the rules that judge it.

State ids are the kernel's (include/rdma/ib_verbs.h: IB_PORT_ACTIVE, and the
phys_state "LinkUp"); the counters are the ones whose increase means the link
or the fabric is unhealthy. The source checks at import that each one is a
metric it exports.
"""

from __future__ import annotations

__all__ = ["ERROR_COUNTERS", "PHYS_LINK_UP", "STATE_ACTIVE"]

STATE_ACTIVE = 4
PHYS_LINK_UP = 5

ERROR_COUNTERS: frozenset[str] = frozenset(
    {
        "gpuwatchd_infiniband_excessive_buffer_overrun_errors_total",
        "gpuwatchd_infiniband_link_downed_total",
        "gpuwatchd_infiniband_link_error_recovery_total",
        "gpuwatchd_infiniband_local_link_integrity_errors_total",
        "gpuwatchd_infiniband_port_discards_transmitted_total",
        "gpuwatchd_infiniband_port_errors_received_total",
        "gpuwatchd_infiniband_port_receive_remote_physical_errors_total",
        "gpuwatchd_infiniband_symbol_error_total",
    }
)
