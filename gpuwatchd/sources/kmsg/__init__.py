"""Kernel log: readers (/dev/kmsg, journald, a file), the line parser for Xid/SXid and driver
reports, and the source that turns them into events.
"""
