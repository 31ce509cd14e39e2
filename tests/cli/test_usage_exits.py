"""No usage error exits 2, which every monitoring-plugin caller reads as CRITICAL: 3 (UNKNOWN)
for the plugin commands (`check`, `diag`), 64 (EX_USAGE) for the rest, 66 (EX_NOINPUT) for an
input file that cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.cli import main


def _exit_of(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own exits (usage errors, --help)
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        ([], 64),
        (["no-such-command"], 64),
        (["run", "--log-level", "loud"], 64),
        (["run", "--no-such-flag"], 64),
        (["config"], 64),
        (["config", "check"], 64),
        (["xid"], 64),
        (["xid", "explain"], 64),
        (["xid", "scan", "/nonexistent/kern.log"], 66),
        (["clear"], 64),
        (["clear", "--gpu", "0", "--all"], 64),
        (["record"], 64),
        (["hang", "show", "--no-such-flag"], 64),
        (["check", "--timeout", "-1"], 3),
        (["check", "--timeout", "inf"], 3),
        (["check", "--json", "--format", "npd"], 3),
        (["check", "--format", "xml"], 3),
        (["check", "--no-such-flag"], 3),
        (["diag", "--timeout", "-1"], 3),
        (["diag", "--gpu", "-1"], 3),
        (["diag", "--dcgm-level", "9"], 3),
    ],
)
def test_usage_errors_never_exit_2(
    argv: list[str],
    code: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("GPUWATCHD_STATE_DIR", str(tmp_path / "state"))
    assert _exit_of(argv) == code
    out = capsys.readouterr()
    assert out.out == "", out.out  # refused before anything ran (no check, no diag)
    assert out.err.strip(), "a usage error says what is wrong"


def test_help_is_not_an_error() -> None:
    assert _exit_of(["diag", "--help"]) == 0
