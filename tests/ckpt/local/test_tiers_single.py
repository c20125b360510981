"""Two tiers in one process (no process group): a full local disk is one logged error per save and training goes on
with the global tier; resume then takes the global tier and says why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.local import LocalCheckpointManager, TwoTierCheckpointer


@pytest.fixture
def writer_stopped():
    """The global tier starts this process's checkpoint writer: stop it whatever the test does."""
    yield
    ckpt.finalize_before_exit()


def test_disk_full_local_tier_training_goes_on_with_the_global_tier(tmp_path: Path, tmpfs, writer_stopped,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    local_root = tmpfs("1m", name="local")
    state = {"w": torch.zeros(512, 1024)}  # 2 MiB: never fits in the 1 MiB local root
    tiers = TwoTierCheckpointer(LocalCheckpointManager(local_root), tmp_path / "global", local_every=1, global_every=3)
    kinds = []
    with caplog.at_level(logging.ERROR, logger="ckpt.local.tiers"):
        for step in range(1, 5):
            state["w"].fill_(step)
            kinds.append(tiers.step(step, state))
        tiers.close()
    assert kinds == ["local", "local", "global", "local"]  # started; each fails in the writer process
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3 and all("not enough space" in e and "global tier still covers" in e for e in errors)
    assert all("local checkpoint of iteration" in e and "\n" not in e for e in errors)
    fresh = {"w": torch.zeros(512, 1024)}
    result = TwoTierCheckpointer(LocalCheckpointManager(local_root), tmp_path / "global", local_every=1,
                                 global_every=3).resume(fresh)
    assert (result.iteration, result.tier) == (3, "global") and "no restorable local checkpoint" in result.reason
    assert torch.equal(fresh["w"], torch.full((512, 1024), 3.0))
