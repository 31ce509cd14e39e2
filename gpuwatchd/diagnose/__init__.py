"""Diag runs on the daemon's side: one run (`run`), and when the daemon starts one (`scheduler`).

Daemon layer: it ties the NVML reads and the worker (sources), the floors
(health) and the store (sinks) together, for the CLI and the daemon. Nothing is
imported here: the daemon loads the scheduler at start, a run's machinery
(`run`) with the first run.
"""
