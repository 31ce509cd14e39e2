"""The package's data files, read through the loader (`gpuwatchd.shipped`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatchd.shipped import shipped_text

DATA = Path(__file__).resolve().parent.parent / "gpuwatchd" / "data"


@pytest.mark.parametrize("path", sorted(DATA.iterdir()), ids=lambda p: p.name)
def test_every_data_file_reads_as_on_disk(path: Path) -> None:
    assert shipped_text(path.name) == path.read_text(encoding="utf-8")


def test_the_xid_catalog_is_json() -> None:
    assert json.loads(shipped_text("xid-catalog.json"))


def test_a_missing_file_is_an_os_error() -> None:
    with pytest.raises(OSError):
        shipped_text("no-such-catalog.yaml")
