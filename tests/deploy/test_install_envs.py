"""`make install` and the image's Python environment import every backend the docs promise.

Both are built for real, offline, from the wheelhouse that `scripts/setup --dev` fills
(`.venv/wheelhouse`: every package pinned in requirements.txt, systemd-python built once,
and the build backend): `make install` into a temporary prefix, and the Dockerfile's
build stage (its WORKDIR, COPY and pip lines; its apt-get lines are what scripts/setup
installs) into a temporary root, without Docker. pip runs with --no-index, so a
dependency that pyproject.toml declares and requirements.txt does not pin fails here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import ROOT
from tests.deploy.test_dockerfile import instructions

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.11 has it
    pytest.skip("tomllib", allow_module_level=True)

WHEELHOUSE = Path(os.environ.get("GPUWATCHD_WHEELHOUSE") or Path(sys.prefix) / "wheelhouse")
IMAGE_EXTRAS = ("systemd", "pod-resources")  # what the Dockerfile installs
HOST_EXTRAS = ("systemd",)  # what `make install` installs by default
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")

# What docs/deploy.md, docs/kernel-log.md, docs/workloads.md and docs/http.md promise:
# the journald reader and sd_notify, udev events, libyaml, bcrypt for web-config
# passwords, NVML; in the image also the kubelet pod-resources client.
HOST_IMPORTS = """
import os, sys
import bcrypt, pynvml, pyudev, yaml
from systemd import daemon, journal
import gpuwatchd
assert gpuwatchd.__file__.startswith(sys.prefix), gpuwatchd.__file__
assert yaml.CSafeLoader, "PyYAML without libyaml"
assert bcrypt.checkpw(b"pw", bcrypt.hashpw(b"pw", bcrypt.gensalt(4)))
assert journal.Reader and daemon.notify
pyudev.Context()  # loads libudev
from gpuwatchd.sources.kmsg import journal as _reader
"""
IMAGE_IMPORTS = (
    HOST_IMPORTS
    + """
import grpc
from gpuwatchd.sources.workloads.proto import api_pb2, api_pb2_grpc
assert api_pb2_grpc.PodResourcesListerStub and api_pb2.ListPodResourcesRequest()
"""
)


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"requirements.txt: {line!r} is not pinned with =="
            pins[_norm(name)] = version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_runtime_dependency_and_installed_extra_is_pinned() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in {*IMAGE_EXTRAS, *HOST_EXTRAS}:
        wanted += project["optional-dependencies"][extra]
    pins = _pins()
    for spec in wanted:
        req = Requirement(spec)
        assert _norm(req.name) in pins, f"{req.name} is not pinned in requirements.txt"
        assert req.specifier.contains(pins[_norm(req.name)]), (spec, pins[_norm(req.name)])
    extras = ",".join(IMAGE_EXTRAS)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f'".[{extras}]"' in dockerfile
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^EXTRAS\s+\?= systemd$", makefile, re.M)
    # the pins bind only as constraints of the install itself
    assert re.search(r"^CONSTRAINTS\s+\?= requirements.txt$", makefile, re.M)
    assert '-c "$(CONSTRAINTS)"' in makefile and "-c requirements.txt" in dockerfile


def _offline_env() -> dict[str, str]:
    if not (WHEELHOUSE.is_dir() and any(WHEELHOUSE.glob("systemd_python-*.whl"))):
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: run scripts/setup --dev")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(WHEELHOUSE),
        PIP_CONFIG_FILE=os.devnull,  # no index or find-links from the machine's pip config
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_CACHE_DIR="1",
    )
    return env


def _check_imports(python: Path, script: str, cwd: Path) -> None:
    res = subprocess.run(
        [str(python), "-c", script],
        cwd=cwd,
        env=_offline_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_make_install_tree_imports_every_promised_backend(tmp_path: Path) -> None:
    src = _dir(tmp_path / "src")  # a copy, so that building the package writes nothing here
    for name in ("Makefile", "pyproject.toml", "README.md", "requirements.txt"):
        shutil.copy(ROOT / name, src)
    shutil.copy(ROOT / "config.example.yaml", src)
    shutil.copytree(ROOT / "gpuwatchd", src / "gpuwatchd", ignore=IGNORE)
    shutil.copytree(ROOT / "deploy" / "systemd", src / "deploy" / "systemd", ignore=IGNORE)
    (src / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "deploy.md", src / "docs")
    root = tmp_path / "root"
    dirs = {
        "PREFIX": "opt/gpuwatchd",
        "SYSCONFDIR": "etc",
        "BINDIR": "usr/local/bin",
        "UNITDIR": "usr/local/lib/systemd/system",
        "SYSUSERSDIR": "usr/local/lib/sysusers.d",
        "DOCDIR": "usr/local/share/doc/gpuwatchd",
    }
    args = [f"{k}={root / v}" for k, v in dirs.items()]
    res = subprocess.run(
        ["make", "-C", str(src), "install", f"PYTHON={sys.executable}", *args],
        env=_offline_env(),
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    venv = root / "opt" / "gpuwatchd"
    _check_imports(venv / "bin" / "python", HOST_IMPORTS, tmp_path)
    version = subprocess.run(
        [str(root / "usr/local/bin/gpuwatchd"), "--version"],
        env=_offline_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert version.stdout.startswith("gpuwatchd ")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_image_build_stage_venv_imports_every_promised_backend(tmp_path: Path) -> None:
    steps = instructions((ROOT / "Dockerfile").read_text())
    froms = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    root = tmp_path / "root"  # the image's / in the build stage
    workdir = root
    env = _offline_env()
    # `python` is the image's interpreter: this one (the wheels are built for it)
    bindir = _dir(tmp_path / "bin")
    (bindir / "python").symlink_to(sys.executable)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    ran = []
    for op, rest in steps[froms[0] + 1 : froms[1]]:
        if op == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(rest)))
        elif op == "WORKDIR":
            workdir = _dir(root / rest.lstrip("/"))
        elif op == "COPY":
            *sources, dest = shlex.split(rest)
            target = workdir / dest if not dest.startswith("/") else root / dest.lstrip("/")
            for s in sources:
                if (ROOT / s).is_dir():  # COPY gpuwatchd ./gpuwatchd
                    shutil.copytree(ROOT / s, target, ignore=IGNORE)
                else:
                    shutil.copy(ROOT / s, _dir(target))
        elif op == "RUN" and "apt-get" not in rest:
            command = rest.replace("/opt/", f"{root}/opt/")
            res = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=200,
                check=False,
            )
            assert res.returncode == 0, (rest, (res.stdout + res.stderr)[-3000:])
            ran.append(rest)
    assert any("pod-resources" in r for r in ran), "the Dockerfile no longer installs the extra"
    _check_imports(root / "opt" / "gpuwatchd" / "bin" / "python", IMAGE_IMPORTS, tmp_path)


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
