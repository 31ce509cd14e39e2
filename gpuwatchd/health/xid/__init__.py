"""Xid handling: the catalog (code -> severity, action, remediation), merging the kernel log's and
NVML's reports, the per-GPU tracker and the consumer step that feeds them.
"""
