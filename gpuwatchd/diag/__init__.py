"""The diag worker: CUDA work in a short-lived process of its own (`gpuwatchd[diag]`).

Nothing here is imported by the daemon except the typed `Measurement`;
`python -m gpuwatchd.diag.worker` imports CuPy or PyTorch and prints one
JSON measurement per line. It depends on the standard library alone, so
an interpreter that has the GPU libraries but not gpuwatchd's own
dependencies can run it.
"""
