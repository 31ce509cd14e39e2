"""Fixtures of the end-to-end tests: one real Alertmanager per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import AlertmanagerServer, alertmanager_server


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerServer]:
    """One Alertmanager for every drill in this process (each drill uses its own node)."""
    yield from alertmanager_server(tmp_path_factory)
