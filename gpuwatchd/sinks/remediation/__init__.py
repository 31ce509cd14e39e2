"""Opt-in remediation: drain the node in Slurm, mark it in Kubernetes (see sink.py)."""
