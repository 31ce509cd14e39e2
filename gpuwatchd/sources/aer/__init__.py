"""PCIe AER counters from sysfs for the GPUs, the NICs near them and every bridge up to the root port."""
