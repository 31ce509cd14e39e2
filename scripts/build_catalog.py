#!/usr/bin/env python3
"""Build gpuwatchd/data/xid-catalog.json from the full xid-catalog.yaml.

The YAML is the annotated source (facts, notes, sources); the JSON keeps
only what the daemon reads, so `gpuwatchd xid ...` starts in milliseconds.
Run after editing the YAML; tests/health/test_xid.py fails if they differ.

    python scripts/build_catalog.py          # rewrite the JSON
    python scripts/build_catalog.py --check  # exit 1 if the JSON is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parent.parent / "gpuwatchd" / "data"
SOURCE = DATA / "xid-catalog.yaml"
TARGET = DATA / "xid-catalog.json"
FIELDS = ("code", "name", "mnemonic", "category", "severity", "action", "remediation")


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """The subset of the full catalog the daemon uses."""
    out: dict[str, Any] = {
        "schema_version": data["schema_version"],
        "generated_from": "xid-catalog.yaml (" + str(data.get("generated", "")) + ")",
        "actions": data["actions"],
        "unknown_code": data["unknown_code"],
    }
    for kind in ("xid", "sxid"):
        entries = []
        for raw in data[kind]:
            entry = {k: raw[k] for k in FIELDS if raw.get(k) is not None}
            if raw.get("line_overrides"):
                entry["line_overrides"] = raw["line_overrides"]
            entries.append(entry)
        out[kind] = entries
    return out


def render(path: Path = SOURCE) -> str:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=loader)
    return json.dumps(compact(data), ensure_ascii=False, separators=(",", ":")) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is stale: run scripts/build_catalog.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
