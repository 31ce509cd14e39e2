"""Evidence bundles as their readers see them: list, read, the /evidence route.

The writer (`sinks/evidence.py`) leaves complete bundles only (a `.tmp`
directory renamed into place); a bundle whose metadata does not read is
skipped here and moved aside by the writer at start.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwatchd.config import Config

__all__ = [
    "CORRUPT",
    "EVIDENCE_DIR",
    "META",
    "PARTS",
    "evidence_root",
    "evidence_route",
    "list_bundles",
    "meta_of",
    "read_bundle",
]

EVIDENCE_DIR = "evidence"
META = "meta.json"
PARTS = ("finding.json", "kmsg.txt", "nvml.txt", "events.json", "nvidia-bug-report.log.gz")
CORRUPT = ".corrupt-"  # a bundle moved aside: its metadata could not be read


def evidence_root(cfg: Config) -> str:
    """<state_dir>/evidence."""
    return os.path.join(cfg.daemon.state_dir, EVIDENCE_DIR)


def meta_of(root: str, name: str) -> dict[str, Any] | None:
    """A bundle's metadata if it is whole and sound (id, incident, a finite time, files)."""
    try:
        with open(os.path.join(root, name, META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("id") != name:
        return None
    t = meta.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return None
    if not isinstance(meta.get("incident"), str) or not isinstance(meta.get("files", {}), dict):
        return None
    return meta


def list_bundles(cfg: Config) -> list[dict[str, Any]]:
    """Every complete, sound bundle's metadata, newest first (damaged ones are skipped)."""
    root = evidence_root(cfg)
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        meta = None if CORRUPT in name else meta_of(root, name)
        if meta is not None:  # None: being written (.tmp), damaged or moved aside
            out.append(meta)
    return sorted(out, key=lambda m: (m["time"], m["id"]), reverse=True)


def read_bundle(cfg: Config, bundle_id: str, parts: Sequence[str] = PARTS) -> dict[str, Any] | None:
    """A bundle's metadata and text parts (for /evidence/{id}); None if there is none."""
    if not bundle_id or "/" in bundle_id or bundle_id.startswith("."):
        return None
    for meta in list_bundles(cfg):
        if meta["id"] == bundle_id:
            out: dict[str, Any] = {"meta": meta}
            for name in parts:
                path = os.path.join(evidence_root(cfg), bundle_id, name)
                if os.path.exists(path) and not name.endswith(".gz"):
                    with open(path, encoding="utf-8", errors="replace") as f:
                        out[name] = f.read()
            return out
    return None


def evidence_route(cfg: Config) -> Callable[[Mapping[str, list[str]]], tuple[int, str, bytes]]:
    """GET /evidence (the bundles, newest first) and /evidence/{id} (one, its text parts)."""

    def route(query: Mapping[str, list[str]]) -> tuple[int, str, bytes]:
        wanted = (query.get("id") or [""])[0]
        if wanted:
            doc = read_bundle(cfg, wanted)
            if doc is None:
                return 404, "text/plain", b"no such evidence bundle\n"
            return 200, "application/json", json.dumps(doc, indent=1).encode() + b"\n"
        bundles = list_bundles(cfg)
        body = {"count": len(bundles), "bundles": bundles}
        return 200, "application/json", json.dumps(body, indent=1).encode() + b"\n"

    return route
