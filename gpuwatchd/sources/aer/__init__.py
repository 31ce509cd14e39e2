"""PCIe AER counters from sysfs: the GPUs, nearby NICs and the bridges up to the root port."""
