"""Every subcommand runs inside the one CommandContext: config with overrides read once,
the state dir, the store, and what the command did recorded when it ends."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpuwatchd import app
from gpuwatchd.app import CommandContext
from gpuwatchd.cli import COMMANDS, build_parser
from gpuwatchd.cli import main as cli_main
from gpuwatchd.sinks.diag import last_runs
from gpuwatchd.sinks.store import DB_NAME, EventStore
from tests.diag.fakes import H100_IDLE, HEALTHY_H100, canned


def _argv(tmp: Path) -> dict[str, list[str]]:
    """One quick command line per subcommand (most stop early: a bad config, no store)."""
    bad = tmp / "bad.yaml"
    bad.write_text("no_such_section: 1\n")
    empty = tmp / "empty-state"
    empty.mkdir()
    return {
        "run": ["run", "--config", str(bad)],
        "check": ["check", "--config", str(bad)],
        "clear": ["clear", "--all", "--state-dir", str(empty)],
        "hang": ["hang", "show", "--state-dir", str(empty)],
        "diag": ["diag", "--config", str(bad)],
        "evidence": ["evidence", "list", "--state-dir", str(empty)],
        "xid": ["xid", "explain", "79"],
        "record": ["record", "--out", str(tmp / "x.json"), "--polls", "0"],
        "config": ["config", "default"],
    }


def _handlers(parser: argparse.ArgumentParser) -> set[object]:
    out = {parser.get_default("func")} - {None}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out |= _handlers(child)
    return out


def test_every_subcommand_enters_the_one_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {name.rpartition(".")[2] for name in COMMANDS}
    argvs = _argv(tmp_path)
    assert set(argvs) == names, "a new subcommand needs a line here"
    # every handler of every action takes the context, never the bare arguments
    for handler in _handlers(build_parser()):
        module = str(getattr(handler, "__module__", ""))
        assert module.rpartition(".")[2] in names, handler
    entered: list[str] = []
    enter = CommandContext.__enter__

    def spy(self: CommandContext) -> CommandContext:
        entered.append(self.command)
        return enter(self)

    monkeypatch.setattr(CommandContext, "__enter__", spy)
    for name, argv in argvs.items():
        entered.clear()
        try:
            cli_main(argv)
        except SystemExit:
            pass
        capsys.readouterr()
        assert entered == [name], (name, entered)


def test_diag_reads_the_config_once_and_records_its_run_with_trigger_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwatchd.config import overrides

    loads: list[str | None] = []
    real = overrides.load
    monkeypatch.setattr(overrides, "load", lambda path: loads.append(path) or real(path))
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text("diag: {timeout_seconds: 60}\n")
    worker = canned(tmp_path, HEALTHY_H100)
    argv = ["diag", "--config", str(config), "--nvml-replay", str(H100_IDLE)]
    assert cli_main([*argv, "--fake-worker", worker, "--state-dir", str(state)]) == 0
    assert loads == [str(config)]
    store = EventStore(str(state / DB_NAME))
    try:
        [run] = last_runs(store)
    finally:
        store.close()
    assert (run.verdict, run.trigger) == ("OK", app.CLI_TRIGGER)
    # a state dir that is not there: the verdict stands, the note says why
    capsys.readouterr()
    missing = tmp_path / "nowhere"
    assert cli_main([*argv, "--fake-worker", worker, "--state-dir", str(missing)]) == 0
    assert f"not recorded: no state dir {missing}" in capsys.readouterr().err
