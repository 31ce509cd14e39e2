"""Memory pressure: the kernel's PSI for the node, and the memory cgroups of GPU processes."""
