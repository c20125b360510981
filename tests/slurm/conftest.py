"""One real Slurm for the whole test session (see cluster.py); Slurm tests skip only if it cannot run."""

from __future__ import annotations

import logging

import pytest

from tests.slurm.cluster import ClusterUnavailable, SlurmCluster

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running test Slurm (3 emulated nodes); torn down with a check that nothing is left running."""
    cluster = SlurmCluster(nodes=3)
    try:
        cluster.start()
    except ClusterUnavailable as why:
        pytest.skip(f"no test Slurm: {why}")
    log.info("test Slurm up in %.2f s (%s) at %s", cluster.bringup_seconds, cluster.proctrack, cluster.base)
    yield cluster
    killed = cluster.stop()
    left = cluster.leftovers()
    assert not killed, f"processes of the test Slurm were still running at tear-down: {killed}"
    assert not left, f"processes of the test Slurm survived tear-down: {[p.pid for p in left]}"
