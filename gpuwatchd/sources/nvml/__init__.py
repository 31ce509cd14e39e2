"""NVML: the client boundary (the only pynvml import), per-GPU reads with deadlines, Xid events,
the record/replay backend and the source that publishes GPU samples.
"""
