"""Write one benchmark's section of docs/benchmarks.md, leaving the others alone."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Figures measured by the scripts in `benchmarks/`; each section says when, on
what machine and with which command it was produced. Re-run a script to
refresh its section. Speed is measured here, never asserted in tests.
"""


def machine() -> str:
    """A one-line description of this machine (CPU model, cores, Python)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


_LOCAL_OUTPUTS = ("--json", "--out")  # a local copy of the figures, left out of the command


def _shareable(args: list[str]) -> list[str]:
    """The arguments without those naming a local output file."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _LOCAL_OUTPUTS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _LOCAL_OUTPUTS)):
            out.append(arg)
    return out


def update_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or add) the section `name` of the benchmarks document."""
    today = datetime.date.today().isoformat()
    argv = [os.path.relpath(sys.argv[0]), *_shareable(sys.argv[1:])]
    command = ".venv/bin/python " + " ".join(argv)  # the venv holds what the scripts import
    block = (
        f"<!-- bench:{name} -->\n{body.rstrip()}\n\n"
        f"_Measured {today} on {machine()}; command: `{command}`._\n"
        f"<!-- /bench:{name} -->"
    )
    text = doc.read_text() if doc.exists() else HEADER
    pattern = re.compile(
        rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def publish(
    fig: dict[str, object], title: str, rows: list[str], section: str = "", json_path: str = ""
) -> None:
    """Print the figures as JSON, optionally save them, and write a table section."""
    text = json.dumps(fig, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text)
    if section:
        table = ["| figure | value |", "| --- | --- |", *rows]
        update_section(section, f"## {title} ({section})\n\n" + "\n".join(table))
