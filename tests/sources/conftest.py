"""Fixtures of the source tests: the NVML replay rigs a test makes, closed at its end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sources.nvml_rigs import Rig


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    """Every rig the test makes (`nvml_rigs.rig`), closed at its end; any hung replay call
    is released so its deadline thread ends."""
    made: list[Rig] = []
    yield made
    for r in made:
        r.close()
