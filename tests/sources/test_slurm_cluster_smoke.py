"""The loopback Slurm cluster fixture starts and runs a job (the fixture others build on)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_cluster


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory)


def test_job_runs_and_shows_as_json(slurm: SlurmCluster) -> None:
    job = slurm.submit("sleep 30", name="smoke")
    slurm.wait_state(job, "RUNNING")
    out = slurm.run(["squeue", "--json", "--jobs", job]).stdout
    (mine,) = [j for j in json.loads(out)["jobs"] if j["job_id"] == int(job)]
    assert mine["name"] == "smoke"
    assert mine["job_state"] == "RUNNING"
    slurm.run(["scancel", job])
