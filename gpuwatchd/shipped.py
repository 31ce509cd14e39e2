"""The data files shipped inside the package (gpuwatchd/data/): catalogs and floors.

Read through `pkgutil.get_data`, the loader's own file access: it works for an
installed tree and a zipped one alike, and unlike `importlib.resources.files`
it does not load `zipfile` and the resource readers into a daemon that only
reads four small files once (0.4 MiB of RSS, docs/benchmarks.md).
"""

from __future__ import annotations

import pkgutil

__all__ = ["shipped_text"]


def shipped_text(name: str) -> str:
    """The text of gpuwatchd/data/`name`; OSError when the install lacks it."""
    data = pkgutil.get_data("gpuwatchd", f"data/{name}")
    if data is None:  # a loader without file access: not one pip or a zip import gives
        raise FileNotFoundError(f"gpuwatchd/data/{name}: the package's loader cannot read it")
    return data.decode("utf-8")
