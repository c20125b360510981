"""NVRX_REQUIRE_SLURM=1 turns "the test Slurm did not come up" from a skip into a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import slurm_required

REPO = Path(__file__).resolve().parents[2]
BROKEN = '''
import pytest
from tests.slurm import cluster
from tests.slurm.conftest import slurm_cluster  # noqa: F401  (the fixture under test)

def _refuse(self):
    raise cluster.ClusterUnavailable("slurmctld exited with 1 at start-up: fake")

cluster.SlurmCluster.start = _refuse

def test_needs_slurm(slurm_cluster):
    pass
'''


@pytest.mark.parametrize("value, outcome", [("1", "1 error"), ("", "1 skipped"), ("0", "1 skipped")])
def test_unavailable_slurm_fails_only_when_required(tmp_path, value, outcome):
    (tmp_path / "test_broken.py").write_text(BROKEN)
    env = dict(os.environ, PYTHONPATH=str(REPO), NVRX_REQUIRE_SLURM=value)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs",
                          str(tmp_path / "test_broken.py")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert outcome in res.stdout, res.stdout + res.stderr
    assert "fake" in res.stdout
    assert res.returncode == (1 if value == "1" else 0)
    if value == "1":
        assert "NVRX_REQUIRE_SLURM=1 but the test Slurm did not come up" in res.stdout
        assert "During handling" not in res.stdout


def test_slurm_required_values():
    assert slurm_required({"NVRX_REQUIRE_SLURM": "1"}) and slurm_required({"NVRX_REQUIRE_SLURM": "yes"})
    assert not slurm_required({}) and not slurm_required({"NVRX_REQUIRE_SLURM": "0"})
