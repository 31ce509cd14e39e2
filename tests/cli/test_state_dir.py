"""One state dir for every subcommand: --state-dir, else $GPUWATCHD_STATE_DIR, else the
config's daemon.state_dir, the same for each command that reads or writes it."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatchd import config
from gpuwatchd.cli import build_parser
from gpuwatchd.cli import main as cli_main
from gpuwatchd.model import Action, Event, Finding, Severity, labels_of
from gpuwatchd.sinks.diag import last_runs
from gpuwatchd.sinks.evidence import EvidenceRecorder
from gpuwatchd.sinks.store import DB_NAME, EventStore
from tests.check_config import BOOT_ID
from tests.diag.fakes import H100_IDLE, canned, result

# Commands that never open the state dir: a new command must be added here or to PROBES.
STATELESS = {"record", "xid"}
HANG_JOB = "torch:10.0.0.7:29500"


class Node:
    """A state dir the daemon filled (a hang, an Xid of this boot, an evidence bundle),
    a decoy beside it, and a config for both."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "node-state"
        self.decoy = tmp / "decoy-state"
        self.decoy.mkdir()
        (tmp / "kern.log").write_text("")
        (tmp / "boot_id").write_text(BOOT_ID + "\n")
        (tmp / "blocker").write_text("")  # a file: no state dir can be made below it
        cfg = config.load(str(self.config(self.state)))
        store = EventStore.from_config(cfg)
        now = time.time()
        hang = {"id": 1, "job": HANG_JOB, "reason": "rank 1 died", "since": now - 30}
        store.write(
            [
                (
                    Event("xid", "kmsg", now - 60, code=79, pci_bus_id="0000:00:07.0",
                          severity=Severity.CRITICAL, attrs=(("boot_id", BOOT_ID),)),
                    f"{BOOT_ID}:1",
                    1,
                ),
                (
                    Event("job_hang", "hangs", now - 30, message="job hangs",
                          severity=Severity.CRITICAL,
                          attrs=(("job", HANG_JOB), ("hang_id", "1"),
                                 ("forensics", json.dumps(hang)))),
                    "hang:1",
                    1,
                ),
            ]
        )  # fmt: skip
        store.close()
        finding = Finding(
            rule="xid",
            alertname="GpuXidCritical",
            scope="gpu",
            subject=labels_of({"pci_bus_id": "0000:00:07.0"}),
            severity=Severity.CRITICAL,
            reason="Xid 79",
            action=Action.REBOOT_NODE,
            remediation="reboot",
            since=1.0,
        )
        self.bundle = EvidenceRecorder(cfg, None).ensure(finding, "raised")

    def config(self, state: Path) -> Path:
        path = self.tmp / f"config-{state.name}.yaml"
        path.write_text(
            f"daemon: {{state_dir: {state}}}\n"
            f"paths: {{kmsg: {self.tmp / 'kern.log'}, boot_id: {self.tmp / 'boot_id'},"
            f" dev_shm: {self.tmp}, sysfs: {self.tmp}}}\n"
            "sources:\n  nvml: {enabled: false}\n"
            f"  kmsg: {{backend: file, file: {self.tmp / 'kern.log'}}}\n"
        )
        return path


Probe = Callable[[Node, Path, "pytest.CaptureFixture[str]", list[str]], None]


def _hang(node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert cli_main(["hang", "show", *extra]) == 0
    assert f"hang 1 (event 2) job {HANG_JOB}" in capsys.readouterr().out


def _evidence(
    node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    assert cli_main(["evidence", "list", *extra]) == 0
    assert capsys.readouterr().out.startswith(f"{node.bundle}  ")


def _check(node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert cli_main(["check", "--json", *extra]) == 2  # the stored Xid of this boot
    report = json.loads(capsys.readouterr().out)
    assert {c["alertname"] for c in report["conditions"]} >= {"GpuXidCritical"}


def _clear(node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert cli_main(["clear", "--all", "--reason", "reseated", *extra]) == 0
    capsys.readouterr()
    store = EventStore(str(state / DB_NAME))
    try:
        assert [c.reason for c in store.clears_since(0)] == ["reseated"]
    finally:
        store.close()


def _config(node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    # `config check FILE` answers whether `run` would start: the same state dir
    config_file = extra[extra.index("--config") + 1]
    rest = [a for a in extra if a not in ("--config", config_file)]
    assert cli_main(["config", "check", config_file, *rest]) == 78
    assert f"cannot create {state}:" in capsys.readouterr().err


def _run(node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    # `run` would start the daemon: every dir it is offered lies below a file, so it
    # stops at the check and names the one it chose.
    assert cli_main(["run", "--listen", "127.0.0.1:0", *extra]) == 78
    assert f"cannot create {state}:" in capsys.readouterr().err


def _diag(node: Node, state: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    # a failing run (gemm far below its floor) lands in that dir's store, trigger cli
    worker = canned(node.tmp, [result("gemm", "0", 100.0, "TFLOP/s")], "slow.jsonl")
    rc = cli_main(["diag", "--nvml-replay", str(H100_IDLE), "--fake-worker", worker, *extra])
    assert rc == 2, capsys.readouterr()
    capsys.readouterr()
    store = EventStore(str(state / DB_NAME))
    try:
        [run] = last_runs(store)
    finally:
        store.close()
    assert (run.tier, run.verdict, run.trigger) == ("quick", "CRITICAL", "cli")


PROBES: dict[str, Probe] = {
    "check": _check,
    "clear": _clear,
    "config": _config,
    "diag": _diag,
    "evidence": _evidence,
    "hang": _hang,
    "run": _run,
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out |= _options(child)
    return out


def test_every_subcommand_is_listed_and_the_stateful_ones_take_the_flag() -> None:
    commands = _commands()
    assert set(commands) == set(PROBES) | STATELESS
    for name in PROBES:
        assert "--state-dir" in _options(commands[name]), name
    for name in STATELESS:
        assert "--state-dir" not in _options(commands[name]), name


@pytest.mark.parametrize("way", ["flag", "environment", "config"])
@pytest.mark.parametrize("command", sorted(PROBES))
def test_every_subcommand_finds_the_state_dir_the_same_way(
    command: str,
    way: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The flag wins over the environment, the environment over the config; the loser of
    each comparison names the decoy, so a command that skips a step reads the wrong one."""
    node = Node(tmp_path)
    state, decoy = node.state, node.decoy
    if command in ("run", "config"):
        state, decoy = tmp_path / "blocker" / "state", tmp_path / "blocker" / "decoy"
    if way == "flag":
        monkeypatch.setenv("GPUWATCHD_STATE_DIR", str(decoy))
        extra = ["--config", str(node.config(decoy)), "--state-dir", str(state)]
    elif way == "environment":
        monkeypatch.setenv("GPUWATCHD_STATE_DIR", str(state))
        extra = ["--config", str(node.config(decoy))]
    else:
        monkeypatch.delenv("GPUWATCHD_STATE_DIR", raising=False)
        extra = ["--config", str(node.config(state))]
    PROBES[command](node, state, capsys, extra)


def test_evidence_show_without_an_id_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["evidence", "show", "--state-dir", str(tmp_path)])
    assert exit_.value.code == 64  # EX_USAGE: exit 2 reads as CRITICAL to monitoring
    err = capsys.readouterr().err
    assert "usage: gpuwatchd evidence show" in err and "required: id" in err


def test_evidence_show_prints_the_files_and_json_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    node = Node(tmp_path)
    monkeypatch.setenv("GPUWATCHD_STATE_DIR", str(node.state))
    assert cli_main(["evidence", "show", node.bundle]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith(f"bundle {node.bundle}  ") and "raised: GpuXidCritical" in lines[0]
    # each file as the text it holds: its lines, no escaped newlines, no JSON quoting
    assert "--- finding.json ---" in lines and "--- kmsg.txt ---" in lines
    assert ' "alertname": "GpuXidCritical",' in lines
    assert "\\n" not in text
    assert cli_main(["evidence", "--json", "show", node.bundle]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["id"] == node.bundle and "finding.json" in doc
    assert cli_main(["evidence", "show", "nope"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"gpuwatchd evidence: no bundle 'nope' in {node.state}"
    )
