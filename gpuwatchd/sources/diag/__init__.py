"""Active GPU diagnostics, the daemon's side: NVML reads, the worker process, dcgmi.

The CUDA work runs in `python -m gpuwatchd.diag.worker`, started by
`runner` in its own process group and killed as a group to cancel; the
daemon and the CLI never import CUDA.
"""
