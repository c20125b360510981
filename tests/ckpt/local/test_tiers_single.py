"""Two tiers in one process (no process group): a full local disk is one logged error per save and training goes on
with the global tier; resume then takes the global tier and says why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from nvrx import ckpt
from nvrx.ckpt.local import LocalCheckpointManager, TwoTierCheckpointer


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
    with caplog.at_level(logging.ERROR, logger="nvrx.ckpt.local.tiers"):
        for step in range(1, 5):
            state["w"].fill_(step)
            kinds.append(tiers.step(step, state))
        tiers.close()
    # step 1 starts a local save; later ones start unless the previous is still being written (then skipped)
    assert kinds[0] == "local" and kinds[2] == "global" and set(kinds[1::2]) <= {"local", None}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == kinds.count("local")  # every started local save fails in the writer, said once
    assert all("not enough space" in e and "global tier still covers" in e for e in errors)
    assert all("local checkpoint of iteration" in e and "\n" not in e for e in errors)
    fresh = {"w": torch.zeros(512, 1024)}
    result = TwoTierCheckpointer(LocalCheckpointManager(local_root), tmp_path / "global", local_every=1,
                                 global_every=3).resume(fresh)
    assert (result.iteration, result.tier) == (3, "global") and "no restorable local checkpoint" in result.reason
    assert torch.equal(fresh["w"], torch.full((512, 1024), 3.0))


def test_a_local_save_still_being_written_is_skipped_not_waited_for(tmp_path: Path, writer_stopped,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import os
    import signal

    from nvrx.ckpt.async_ckpt.writer_process import default_writer

    local = LocalCheckpointManager(tmp_path / "local")
    tiers = TwoTierCheckpointer(local, tmp_path / "global", local_every=1, global_every=100)
    writer = default_writer()
    os.kill(writer.pid, signal.SIGSTOP)  # a writer starved by a busy machine: the save cannot finish yet
    try:
        state = {"w": torch.ones(1024)}
        with caplog.at_level(logging.WARNING, logger="nvrx.ckpt.local.tiers"):
            kinds = [tiers.step(step, state) for step in (1, 2, 3)]
        assert kinds == ["local", None, None] and not local.maybe_finalize()
        skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert skipped == [f"local checkpoint of step {s} skipped: the previous one is still being written" for s in (2, 3)]
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    tiers.close()  # waits for the writer now
    assert local.find_latest() == 1 and (local.local_dir / "iter_000000001_0_local.nvrxl").is_file()
