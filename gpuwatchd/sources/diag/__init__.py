"""Active GPU diagnostics: a short-lived worker process does the CUDA work.

The daemon and the CLI never import CUDA: `runner` starts
`python -m gpuwatchd.sources.diag.worker` in its own process group, reads
one JSON measurement per line, and kills the group to cancel. NVML
counters before and after are read here through the NVML client.
"""
