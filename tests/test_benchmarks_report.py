"""The command line written beside benchmark figures names no local output file."""

from __future__ import annotations

from benchmarks.report import _shareable


def test_local_output_arguments_are_left_out() -> None:
    args = ["--replay", "x.json", "--json", "/somewhere/a.json", "--out=b.json", "--seconds", "3"]
    assert _shareable(args) == ["--replay", "x.json", "--seconds", "3"]
