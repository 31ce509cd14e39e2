"""Diag, the daemon layer: one run (`run`) and when the daemon starts one (`scheduler`).

The feature is named `diag` in every layer it spans: the worker program
(`diag/worker/`, a layer of its own that runs in a process of its own), the
typed run (`model/diag.py`), NVML reads, dcgmi and the worker's runner
(`sources/diag/`), floors and the GpuDiagFailed rule (`health/diag/`), the
stored runs (`sinks/diag.py`) and the command (`cli/diag.py`). This layer
ties them together for the CLI and the daemon. Nothing is imported here:
the daemon loads the scheduler at start, a run's machinery (`run`) with
the first run, and `python -m gpuwatchd.diag.worker` loads nothing of it.
"""
