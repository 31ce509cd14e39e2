"""Flags a new user meets: one state dir for every subcommand, one replay flag, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatchd.cli import main as cli_main
from gpuwatchd.sinks.store import DB_NAME, EventStore

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-probe.json"


def _store(state: Path) -> None:
    state.mkdir(parents=True, exist_ok=True)
    EventStore(str(state / DB_NAME)).close()


def test_every_subcommand_takes_the_state_dir_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # scripts/run exports GPUWATCHD_STATE_DIR; `hang show` and `clear` in that shell find it
    state = tmp_path / "state"
    _store(state)
    monkeypatch.setenv("GPUWATCHD_STATE_DIR", str(state))
    assert cli_main(["hang", "show"]) == 0
    assert capsys.readouterr().out.strip() == "no job hang recorded"
    assert cli_main(["clear", "--all", "--reason", "fixed"]) == 0
    assert "cleared all GPUs" in capsys.readouterr().out
    store = EventStore(str(state / DB_NAME))
    try:
        assert [c.reason for c in store.clears_since(0)] == ["fixed"]
    finally:
        store.close()
    # the flag still wins over the environment
    assert cli_main(["hang", "show", "--state-dir", str(tmp_path / "other")]) == 1
    assert f"no event store in {tmp_path / 'other'}" in capsys.readouterr().err


def test_clear_refuses_a_directory_without_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "typo"
    empty.mkdir()
    assert cli_main(["clear", "--all", "--state-dir", str(empty)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gpuwatchd clear: no event store in {empty}")
    assert list(empty.iterdir()) == []  # nothing created
    # a node that runs only `check` starts its store on purpose
    assert cli_main(["clear", "--all", "--state-dir", str(empty), "--new-store"]) == 0
    assert (empty / DB_NAME).exists()


@pytest.mark.parametrize("flag", ["--nvml-replay", "--from-replay"])
def test_record_spells_the_replay_flag_as_run_and_check_do(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "capture.json"
    argv = ["record", "--out", str(out), flag, str(CAPTURE), "--polls", "1", "--interval", "0"]
    assert cli_main(argv) == 0
    assert json.loads(out.read_text())["format"].startswith("gpuwatchd-nvml-capture/")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main(["record", "--help"])
    usage = capsys.readouterr().out
    assert "--nvml-replay" in usage and "--from-replay" not in usage


@pytest.mark.parametrize(
    ("extra", "rc", "says"),
    [
        (["--interval", "-1"], 64, "gpuwatchd record: --interval: must be >= 0 seconds (got -1)"),
        (["--polls", "0"], 64, "gpuwatchd record: --polls: must be at least 1 (got 0)"),
        (["--call-timeout", "0"], 64, "gpuwatchd record: --call-timeout: must be > 0 seconds"),
    ],
)
def test_record_flag_errors_are_one_line(
    tmp_path: Path, extra: list[str], rc: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "capture.json"
    assert cli_main(["record", "--out", str(out), "--nvml-replay", str(CAPTURE), *extra]) == rc
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says), err
    assert not out.exists()


def test_record_names_a_broken_capture_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = tmp_path / "capture.json"
    assert cli_main(["record", "--out", str(out), "--nvml-replay", str(bad)]) == 78
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gpuwatchd record: --nvml-replay {bad}: "), err
    assert "line 1 column 2" in err[0]
    assert cli_main(["record", "--out", str(out), "--nvml-replay", str(tmp_path / "no")]) == 78
    assert capsys.readouterr().err.strip().endswith(": No such file or directory")


def test_check_rejects_json_with_another_format(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["check", "--json", "--format", "npd", "--nvml-replay", str(CAPTURE)])
    assert rc == 3  # a usage error of a plugin command: UNKNOWN, never 2 (CRITICAL)
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert err == ["gpuwatchd check: --json means --format json; it cannot go with --format npd"]
