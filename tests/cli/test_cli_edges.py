"""CLI rough edges: a closed pipe, recording without NVML, flag errors, unknown codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatchd.cli import main as cli_main
from gpuwatchd.cli.record import main as record_main

ROOT = Path(__file__).resolve().parents[2]
H200X2 = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-probe.json"
FALLEN = (
    "[  100.000000] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n"
    "[  100.000100] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
    "GPU has fallen off the bus.\n"
)


def test_scan_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(FALLEN * 2000)
    scan = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "xid", "scan", str(log)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert scan.stdout is not None
    scan.stdout.readline()  # what `| head -1` reads, then the reader goes away
    scan.stdout.close()
    _, err = scan.communicate(timeout=60)
    assert scan.returncode == 0
    assert b"BrokenPipe" not in err and b"Traceback" not in err


def test_fallen_off_the_bus_and_its_xid_79_are_one_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(FALLEN)
    assert cli_main(["xid", "scan", "--json", str(log)]) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["code"], r["pci_bus_id"]) for r in reports] == [(79, "0000:3b:00.0")]
    # a second fall much later is a second event
    log.write_text(FALLEN + "filler\n" * 20 + FALLEN)
    assert cli_main(["xid", "scan", "--json", str(log)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_explain_unknown_code_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["xid", "explain", "99999"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "99999 · unknown code"
    assert "Xid" not in out.splitlines()[0] and "NVSwitch code" not in out


def test_record_without_nvml_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = json.loads(H200X2.read_text())
    capture["script"] = [{"call": "init", "error": "DRIVER_NOT_LOADED"}]
    broken = tmp_path / "no-driver.json"
    broken.write_text(json.dumps(capture))
    out = tmp_path / "capture.json"
    assert record_main(["--out", str(out), "--from-replay", str(broken)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("gpuwatchd record: NVML is not usable here: DRIVER_NOT_LOADED")
    assert err[0].endswith("; nothing written")
    assert not out.exists()


def test_flag_errors_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = cli_main(["run", "--listen", "127.0.0.1:0", "--state-dir", str(blocker / "state")])
    assert rc == 78
    text = capsys.readouterr().err
    assert "command line: --state-dir: cannot create" in text
    assert "<defaults>" not in text


def test_scan_names_the_mig_instance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kern.log"
    log.write_text(
        "[  200.000000] NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 43, pid=4242, "
        "name=python3, Ch 00000008\n"
    )
    assert cli_main(["xid", "scan", str(log)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "0000:3b:00.0" in line and "[GI 1 CI 0]" in line and "python3[4242]" in line
    assert cli_main(["xid", "scan", "--json", str(log)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["extras"] == {"gpu_instance": "1", "compute_instance": "0"}


def test_check_flag_errors_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["check", "--nvml-replay", str(tmp_path / "missing.json")]) == 78
    err = capsys.readouterr().err
    assert "command line: --nvml-replay: cannot read" in err and "<defaults>" not in err
