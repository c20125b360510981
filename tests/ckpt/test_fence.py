"""No split brain on disk: checkpoints of a round the job has left are fenced out (nvrx/ckpt/fence.py).

Real saves through AsyncCheckpointer (real writer process, real files); the launch and round a rank is in are
what `nvrx launch` gives it (NVRX_LAUNCH, NVRX_ROUND), set here as the agent would.
"""

from __future__ import annotations

import os
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
