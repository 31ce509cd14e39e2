"""Workloads: who runs on each GPU (cgroup, kubelet pod-resources, Slurm, torch ranks)."""
