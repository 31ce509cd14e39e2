"""The systemd unit: systemd's own verifier and security review, and `make install`.

`systemd-analyze` runs offline here (no PID 1 systemd needed). The unit's
runtime behaviour (READY/WATCHDOG/STOPPING) is tested against a real
notify socket in tests/test_daemon.py.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatchd import __version__
from tests.conftest import ROOT

UNIT = ROOT / "deploy" / "systemd" / "gpuwatchd.service"
SYSUSERS = ROOT / "deploy" / "systemd" / "gpuwatchd.sysusers"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")


def unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order (keys may repeat)."""
    out: list[tuple[str, str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {raw!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def values(key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in unit_entries(UNIT.read_text()) if s == section and k == key]


def test_comments_only_on_their_own_line() -> None:
    # systemd would read "yes # why" as the value "yes # why"
    for s, k, v in unit_entries(UNIT.read_text()):
        assert "#" not in v, f"[{s}] {k}={v}: comment after a value"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("Restart", "on-failure"),
        ("RestartPreventExitStatus", "78"),
        ("DevicePolicy", "closed"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("StateDirectory", "gpuwatchd"),
        ("ConfigurationDirectory", "gpuwatchd"),
        ("CapabilityBoundingSet", "CAP_SYSLOG"),
        ("AmbientCapabilities", "CAP_SYSLOG"),
        ("User", "gpuwatchd"),
        ("NoNewPrivileges", "yes"),
        # the two options that silently break the daemon must stay off
        ("ProtectKernelLogs", "no"),
        ("PrivateDevices", "no"),
    ],
)
def test_required_settings(key: str, expected: str) -> None:
    assert values(key) == [expected]


def test_devices_kmsg_read_and_nvidia_groups() -> None:
    allow = values("DeviceAllow")
    assert "/dev/kmsg r" in allow
    assert "char-nvidia* rw" in allow
    assert all(not a.startswith("/dev/nvidia") for a in allow), "paths miss driver flavours"


def test_timeouts_leave_room_for_nvml() -> None:
    start = int(values("TimeoutStartSec")[0])
    watchdog = int(values("WatchdogSec")[0])
    assert start >= 120, "NVML init on 8 GPUs can take tens of seconds"
    # the daemon's loop pings at half WatchdogSec and withholds it after 30 s of no progress
    assert watchdog >= 60


def test_execstart_uses_config_and_venv() -> None:
    (execstart,) = values("ExecStart")
    assert execstart == "/opt/gpuwatchd/bin/gpuwatchd run --config /etc/gpuwatchd/config.yaml"


def test_sysusers_declares_the_unit_user() -> None:
    lines = [ln.split() for ln in SYSUSERS.read_text().splitlines() if ln and ln[0] != "#"]
    assert [ln[:2] for ln in lines] == [["u", "gpuwatchd"]]


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60, check=False)


@needs_analyze
def test_security_score_matches_docs() -> None:
    res = analyze("security", "--offline=true", "--no-pager", str(UNIT))
    assert res.returncode == 0, res.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", res.stdout)
    assert match, res.stdout[-500:]
    score = float(match.group(1))
    assert score <= 2.0, f"exposure {score} regressed:\n{res.stdout}"
    doc = DEPLOY_DOC.read_text()
    assert f"exposure {score}" in doc, f"docs/deploy.md must state the score ({score})"
    # every setting the review still marks as exposed is explained in the docs
    for line in res.stdout.splitlines():
        if line.startswith("✗"):
            setting = line.split()[1].split("=")[0]
            assert f"`{setting}" in doc, f"{setting} is exposed but not explained in deploy.md"


def make_install(tmp: Path) -> Path:
    """`make install DESTDIR=...` from a clean copy of the tree; returns DESTDIR."""
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "tests", "__pycache__", "*.egg-info", "build", "dist", ".*cache"
        ),
    )
    wheels = tmp / "wheels"
    # Build the wheel here (no network: no build isolation), install it without deps.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = wheels.glob("gpuwatchd-*.whl")
    dest = tmp / "dest"
    res = subprocess.run(
        [
            "make",
            "-C",
            str(src),
            "install",
            f"DESTDIR={dest}",
            f"PYTHON={sys.executable}",
            f"SRC={wheel}",
            "PIP_INSTALL_ARGS=--no-deps --no-index",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    return make_install(tmp_path_factory.mktemp("install"))


def test_make_install_lays_out_files(installed: Path) -> None:
    d = installed
    for path in (
        "opt/gpuwatchd/bin/gpuwatchd",
        "opt/gpuwatchd/bin/python",
        "usr/local/lib/systemd/system/gpuwatchd.service",
        "usr/local/lib/sysusers.d/gpuwatchd.conf",
        "etc/gpuwatchd/config.yaml",
        "usr/local/share/doc/gpuwatchd/deploy.md",
        "opt/gpuwatchd/share/sandbox_check.py",
    ):
        assert (d / path).exists(), path
    assert os.readlink(d / "usr/local/bin/gpuwatchd") == "/opt/gpuwatchd/bin/gpuwatchd"
    assert (d / "etc/gpuwatchd/config.yaml").read_text() == (
        ROOT / "config.example.yaml"
    ).read_text()
    assert (d / "usr/local/lib/systemd/system/gpuwatchd.service").read_text() == UNIT.read_text()


def test_installed_scripts_point_at_prefix_not_destdir(installed: Path) -> None:
    script = installed / "opt/gpuwatchd/bin/gpuwatchd"
    assert script.read_text().splitlines()[0] == "#!/opt/gpuwatchd/bin/python"
    for f in (installed / "opt/gpuwatchd/bin").iterdir():
        if f.is_file() and not f.is_symlink():
            assert str(installed) not in f.read_text(errors="replace"), f


def test_installed_package_imports(installed: Path) -> None:
    py = installed / "opt/gpuwatchd/bin/python"
    res = subprocess.run(
        [str(py), "-c", "import gpuwatchd; print(gpuwatchd.__file__, gpuwatchd.__version__)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=installed,
    )
    assert res.returncode == 0, res.stderr
    where, version = res.stdout.split()
    assert where.startswith(str(installed / "opt/gpuwatchd/lib/")), where
    assert version == __version__
    assert "gpuwatchd.cli" in (installed / "opt/gpuwatchd/bin/gpuwatchd").read_text()


def test_reinstall_keeps_edited_config(tmp_path: Path, installed: Path) -> None:
    dest = tmp_path / "dest"
    shutil.copytree(installed / "etc", dest / "etc", symlinks=True)
    cfg = dest / "etc/gpuwatchd/config.yaml"
    cfg.write_text("daemon:\n  log_level: debug\n")
    res = subprocess.run(
        ["make", "-C", str(ROOT), "install-files", f"DESTDIR={dest}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert cfg.read_text() == "daemon:\n  log_level: debug\n"


@needs_analyze
def test_systemd_analyze_verify_installed_unit(installed: Path, tmp_path: Path) -> None:
    """systemd's verifier on the installed unit, with ExecStart under DESTDIR.

    verify checks that ExecStart is executable, so the copy points it into the
    staging tree; nothing else in the unit is changed.
    """
    unit = tmp_path / "gpuwatchd.service"
    text = (installed / "usr/local/lib/systemd/system/gpuwatchd.service").read_text()
    unit.write_text(text.replace("ExecStart=/opt/", f"ExecStart={installed}/opt/"))
    res = analyze("verify", "--man=no", str(unit))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.strip() == "", res.stderr


@needs_analyze
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    # the verifier must be able to fail: an unknown key in [Service]
    unit = tmp_path / "gpuwatchd.service"
    unit.write_text(UNIT.read_text().replace("Type=notify", "Type=notify\nWatchdogSecs=5"))
    res = analyze("verify", "--man=no", str(unit))
    assert "WatchdogSecs" in res.stderr


def test_unit_parses_as_ini() -> None:
    # one more independent parser: duplicate keys allowed, sections as systemd names them
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    assert parser.sections() == ["Unit", "Service", "Install"]
    assert parser["Install"]["WantedBy"] == "multi-user.target"
