"""Job hangs in the daemon: the machinery around the health layer's `HangFindings`.

`monitor.HangMonitor` wires it: the consumer's step hands each publish to the
probe loop (`probing.py`, its own thread: /proc of every rank), the detector's
suspicions to the forensics worker (`worker.py`, its own thread: stacks,
NCCL RAS, the flight recorder), writes the hang reports to the store and
serves /hangs. The decisions stay in gpuwatchd.health.hangs; the node's
readers in gpuwatchd.sources.hangs, reached through gpuwatchd.forensics.
"""
