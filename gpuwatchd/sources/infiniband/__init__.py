"""InfiniBand and RoCE ports from sysfs: counters, state, rate and NIC-to-GPU affinity."""
