"""The diag worker: CUDA work in a short-lived process of its own (`gpuwatchd[diag]`).

A layer of its own, beneath all others (tests/test_layering.py): it imports
the standard library, CuPy or PyTorch, and nothing of gpuwatchd outside
this package, so an interpreter that has the GPU libraries but not
gpuwatchd's own dependencies can run it. `python -m gpuwatchd.diag.worker`
prints one JSON measurement per line; the daemon imports only `measure`
(the typed `Measurement` and the check names) to read them.
"""
