"""Workloads: who runs on each GPU (cgroup pod/Slurm attribution; more in later modules)."""
