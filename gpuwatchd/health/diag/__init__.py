"""Diag, the health layer: each measurement against its floor (`verdict`) and the
GpuDiagFailed rule over the stored runs' series (`rule`).

Nothing is imported here: the rule set loads `rule` at start, the floors
(and their YAML parser) load with the first run that judges a measurement.
"""
