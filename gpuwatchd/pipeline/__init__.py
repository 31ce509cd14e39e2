"""The pipeline, wired in one place: sources -> state -> consumers -> sinks.

`consumers` is the chain without a thread or sinks (Xid stage, health
engine) that `check` runs one-shot over the daemon's store read-only;
`source_set` is the sources and their runner, which a reload rebuilds;
`daemon` is the daemon's `Pipeline`: the chain plus the consumer thread, the
store, the hang monitor and the sinks. Only `daemon` loads sinks and HTTP,
so a one-shot command imports what it runs and no more.
"""

from __future__ import annotations

from gpuwatchd.pipeline.consumers import (
    Consumers,
    StoreReader,
    one_shot_config,
    open_store_reader,
    source_names,
)
from gpuwatchd.pipeline.source_set import SourceSet

__all__ = [
    "Consumers",
    "SourceSet",
    "StoreReader",
    "one_shot_config",
    "open_store_reader",
    "source_names",
]
