"""No split brain on disk: checkpoints of a round the job has left are fenced out (nvrx/ckpt/fence.py).

Real saves through AsyncCheckpointer (real writer process, real files); the launch and round a rank is in are
what `nvrx launch` gives it (NVRX_LAUNCH, NVRX_ROUND), set here as the agent would.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from nvrx import ckpt
from nvrx.ckpt.errors import CheckpointError
from nvrx.ckpt.fence import FENCE_FILE
from nvrx.ckpt.loader import find_latest_checkpoint


def _in_round(monkeypatch, launch: int | None, rnd: int | None) -> None:
    for name, value in (("NVRX_LAUNCH", launch), ("NVRX_ROUND", rnd)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def _save(path: Path, step: int) -> None:
    cp = ckpt.AsyncCheckpointer()
    cp.async_save({"w": torch.full((8,), float(step)), "step": step}, path)
    cp.wait()


def _newest(root: Path) -> str:
    info = find_latest_checkpoint(root)
    assert info is not None
    return info.path.name


def test_a_round_the_job_left_cannot_publish_or_be_newest(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ckpt"
    _in_round(monkeypatch, 100, 0)
    _save(root / "step_1", 1)
    _in_round(monkeypatch, 100, 1)  # the others restarted without the cut-off node and look for a checkpoint
    assert _newest(root) == "step_1" and (root / FENCE_FILE).exists()

    _in_round(monkeypatch, 100, 0)  # the cut-off node's ranks, still in round 0, save on
    with pytest.raises(CheckpointError, match="round 0, which the job has left"):
        _save(root / "step_2", 2)
    assert not (root / "step_2").exists()

    # published in the race between that check and the rename: a newer time, but never the newest
    _save(tmp_path / "elsewhere" / "step_3", 3)
    os.rename(tmp_path / "elsewhere" / "step_3", root / "step_3")
    _in_round(monkeypatch, 100, 1)
    assert _newest(root) == "step_1"

    _save(root / "step_4", 4)  # the job's own round goes on
    assert _newest(root) == "step_4"
    _in_round(monkeypatch, 200, 0)  # a later launch (nvrx resume) starts again at round 0
    assert _newest(root) == "step_4"
    _save(root / "step_5", 5)
    assert _newest(root) == "step_5"


def test_checkpoints_saved_without_the_launcher_are_never_fenced(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ckpt"
    _in_round(monkeypatch, 100, 3)
    _save(root / "step_1", 1)
    assert _newest(root) == "step_1"
    _in_round(monkeypatch, None, None)  # torchrun, or a plain script
    _save(root / "step_2", 2)
    assert _newest(root) == "step_2"


def test_a_just_in_time_checkpoint_of_a_round_the_job_left_is_not_published(tmp_path: Path, monkeypatch) -> None:
    """A cut-off node's agent asks its ranks for a just-in-time save (nvrx.ckpt.jit) after the others restarted
    without it and looked for a checkpoint: the save is refused (the agent is told why) and the newest checkpoint
    stays the one the job resumed from; the job's own just-in-time save of a later round is taken."""
    from nvrx.ckpt import jit

    root = tmp_path / "ckpt"
    _in_round(monkeypatch, 100, 0)
    _save(root / "step_1", 1)
    _in_round(monkeypatch, 100, 1)
    assert _newest(root) == "step_1"

    _in_round(monkeypatch, 100, 0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    stale = jit.JitCheckpointer(root, opt, lambda: {"w": torch.full((4,), 7.0)}, lambda gate: 7, lambda: 1)
    result = stale.save([1], 0, 2, time.monotonic() + 10)
    stale.close()
    assert not result["saved"] and "round 0, which the job has left" in result["error"], result
    assert not (root / f"{jit.NAME_PREFIX}000000007").exists()
    _in_round(monkeypatch, 100, 2)
    assert _newest(root) == "step_1"

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    own = jit.JitCheckpointer(root, opt, lambda: {"w": torch.full((4,), 3.0)}, lambda gate: 3, lambda: 1)
    assert own.save([1], 0, 2, time.monotonic() + 10)["saved"]
    own.close()
    assert _newest(root) == f"{jit.NAME_PREFIX}000000003"


def test_the_local_lineage_merges_keeps_each_rounds_first_resume_point_and_reads_garbage_as_nothing(
        tmp_path: Path, monkeypatch) -> None:
    from nvrx.ckpt import fence

    a = [(5, 0, -1), (5, 1, 40)]
    b = [(5, 1, 30), (5, 2, 60)]
    merged = fence.merge_lineage([a, b, [["x"], (5, 3), (1, 2, 3, 4)]])
    assert merged == [(5, 0, -1), (5, 1, 30), (5, 2, 60)]
    assert fence.left_branch((5, 0), 10, merged) is None  # round 1 resumed from 30: it went on from round 0's 10
    assert fence.left_branch((5, 0), 31, merged) == (5, 1, 30)  # written by round 0 after round 1 left it behind
    assert fence.left_branch((5, 1), 45, merged) is None  # round 1's own saves before round 2 resumed at 60
    assert fence.left_branch((5, 1), 61, merged) == (5, 2, 60)  # past round 2's resume point: round 2 left it
    assert fence.left_branch((5, 2), 99, merged) is None and fence.left_branch(None, 99, merged) is None
    assert fence.left_branch((4, 9), 31, merged) == (5, 0, -1)  # an earlier launch: launch 5 began from nothing
    _in_round(monkeypatch, 5, 2)
    assert fence.record_resume(merged, 10) == [(5, 0, -1), (5, 1, 30), (5, 2, 10)]  # looked again, found older
    assert fence.record_resume(merged, 90) == merged  # a round's first resume point stays
    many = fence.merge_lineage([[(1, r, r) for r in range(3 * fence.MAX_LINEAGE)]])
    assert len(many) == fence.MAX_LINEAGE and many[-1] == (1, 3 * fence.MAX_LINEAGE - 1, 3 * fence.MAX_LINEAGE - 1)
    fence.write_lineage(tmp_path, merged)
    assert fence.read_lineage(tmp_path) == merged
    (tmp_path / FENCE_FILE).write_text('{"lineage": "nope"}')
    assert fence.read_lineage(tmp_path) == []
    assert fence.local_save_refused(tmp_path) is None
    fence.write_lineage(tmp_path, [(5, 3, 7)])
    assert "round 2, which the job has left (round 3 resumed there)" in fence.local_save_refused(tmp_path)


def test_a_late_checkpoint_stays_fenced_out_in_every_later_round(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint a round the job had left published in the race (past the check, renamed after the new round
    looked) is present when a still later round (a restart, the healed host rejoining, a new launch) lists the
    directory: that round's fence must not take it into its known names, or it becomes the newest again (it was
    published last). Its publisher, finding the fence past it after the rename, removes it and leaves `latest`."""
    root = tmp_path / "ckpt"
    _in_round(monkeypatch, 100, 0)
    _save(root / "step_1", 1)
    _in_round(monkeypatch, 100, 1)  # the others go on without the cut-off node
    assert _newest(root) == "step_1"
    _save(root / "step_2", 2)
    _in_round(monkeypatch, 100, 0)  # the cut-off node's save, published in the race (elsewhere, then renamed)
    _save(tmp_path / "elsewhere" / "step_9", 9)
    os.rename(tmp_path / "elsewhere" / "step_9", root / "step_9")
    for launch, rnd in ((100, 2), (100, 3), (200, 0)):  # restarts of the job, then a new launch
        _in_round(monkeypatch, launch, rnd)
        assert _newest(root) == "step_2", (launch, rnd)


def test_a_publisher_the_fence_passed_during_the_rename_removes_its_checkpoint(tmp_path: Path, monkeypatch) -> None:
    from nvrx.ckpt import fence
    from nvrx.ckpt.publish import read_latest

    root = tmp_path / "ckpt"
    _in_round(monkeypatch, 100, 0)
    _save(root / "step_1", 1)
    real_check = fence.check_publish

    def check_then_new_round_looks(where: Path, name: str) -> None:
        real_check(where, name)  # passes: no later round looked yet
        _in_round(monkeypatch, 100, 1)
        assert _newest(where) == "step_1"  # ... and now one does, before the rename
        _in_round(monkeypatch, 100, 0)

    monkeypatch.setattr(fence, "check_publish", check_then_new_round_looks)
    with pytest.raises(CheckpointError, match="which the job has left"):
        _save(root / "step_2", 2)
    assert not (root / "step_2").exists() and read_latest(root) == "step_1"
    _in_round(monkeypatch, 100, 2)
    assert _newest(root) == "step_1"
