"""One real Slurm for the whole test session (see cluster.py); Slurm tests skip only if it cannot run.

With NVRX_REQUIRE_SLURM=1 (set by scripts/test.sh when scripts/install_slurm.sh installed Slurm) a test
Slurm that does not come up is a failure, not a skip: the daemons are there, so not starting is a bug.
"""

from __future__ import annotations

import logging
import os

import pytest

from tests.slurm.cluster import ClusterUnavailable, SlurmCluster

log = logging.getLogger(__name__)
REQUIRE_ENV = "NVRX_REQUIRE_SLURM"


def slurm_required(environ: dict[str, str] | os._Environ) -> bool:
    """NVRX_REQUIRE_SLURM is set to a true value (1, true, yes)."""
    return environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running test Slurm (3 emulated nodes); torn down with a check that nothing is left running."""
    cluster = SlurmCluster(nodes=3)
    why = None
    try:
        cluster.start()
    except ClusterUnavailable as exc:
        why = str(exc)
    if why is not None:
        if slurm_required(os.environ):
            pytest.fail(f"{REQUIRE_ENV}=1 but the test Slurm did not come up: {why}", pytrace=False)
        pytest.skip(f"no test Slurm: {why}")
    log.info("test Slurm up in %.2f s (%s) at %s", cluster.bringup_seconds, cluster.proctrack, cluster.base)
    yield cluster
    killed = cluster.stop()
    left = cluster.leftovers()
    assert not killed, f"processes of the test Slurm were still running at tear-down: {killed}"
    assert not left, f"processes of the test Slurm survived tear-down: {[p.pid for p in left]}"
