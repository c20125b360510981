"""Fault matrix: checkpoints under faults (kill during a save, full disk, read-only directory, shared writers)."""

from __future__ import annotations

import os
import random
import signal
import stat
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.writer_process import default_writer
from tests.ckpt.conftest import remount, tmpfs  # noqa: F401  (tmpfs is a fixture)
from tests.ckpt.test_crash_safety import Trainer, check_root
from tests.conftest import pid_gone, tagged_processes, wait_for

SEED = int(os.environ.get("NVRX_FAULTS_SEED", "1515"))


def _small(value: float) -> dict:
    return {"x": torch.full((50_000,), value)}  # 200 kB


def _loaded(root: Path) -> float:
    """The value the newest checkpoint under ROOT loads with (every element must agree: never a mix)."""
    state = _small(-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = ckpt.load_latest(root, state)
    assert info is not None, "no checkpoint loads"
    assert torch.all(state["x"] == state["x"][0]), "a checkpoint mixes two saves"
    return float(state["x"][0])


def _writer_gone(cp: ckpt.AsyncCheckpointer) -> None:
    """Finalize CP and check its writer process is gone."""
    pid = default_writer().pid
    cp.finalize_before_exit()
    assert pid is None or wait_for(lambda: pid_gone(pid), 10), f"writer {pid} left behind"


def test_kill_during_checkpoint_save(tmp_path: Path) -> None:
    """Fault: the training process is SIGKILLed at a random moment of a checkpoint save (seeded trials).
    Outcome: the last completed checkpoint always loads, never a mix of two saves; its writer dies with it.
    """
    rng = random.Random(SEED)
    token = uuid.uuid4().hex
    try:
        for trial in range(2):
            trainer = Trainer(tmp_path, token)
            assert wait_for(lambda: trainer.saved() >= 1 or trainer.proc.poll() is not None, 90), "no first save"
            assert trainer.proc.poll() is None, trainer.proc.stderr.read().decode()[-2000:]
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment of staging, writing, publishing or pruning
            saved = trainer.saved()
            writer = trainer.writer_pid()
            trainer.proc.send_signal(signal.SIGKILL)
            trainer.proc.wait()
            assert wait_for(lambda: pid_gone(writer), 10), f"writer {writer} outlived its trainer (trial {trial})"
            steps = check_root(trainer.root)  # every listed checkpoint is whole and holds one save's values
            info = ckpt.find_latest_checkpoint(trainer.root)
            assert info is not None and info.path.name == f"step_{max(steps):05d}"
            assert len(steps) >= min(saved, 3)  # keep_last=3: every reported save still there (up to 3)
        assert wait_for(lambda: tagged_processes(token) == [], 10), "processes left behind"
    finally:
        for p in tagged_processes(token):
            p.kill()


def test_disk_full(tmpfs) -> None:  # noqa: F811
    """Fault: the disk fills up during a checkpoint write.
    Outcome: one-line CheckpointWriteError naming ENOSPC; the previous checkpoint loads; no half checkpoint is listed.
    """
    root = tmpfs("2m") / "ckpts"
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(_small(1.0), root / "step_0")
    cp.wait()
    cp.async_save({"x": torch.ones(1_000_000)}, root / "step_1")  # 4 MB into 2 MB
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        cp.wait()
    assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
    assert [c.path.name for c in ckpt.list_checkpoints(root)] == ["step_0"]
    assert _loaded(root) == 1.0
    _writer_gone(cp)


def test_read_only_checkpoint_directory(tmpfs) -> None:  # noqa: F811
    """Fault: the checkpoint directory's file system turns read-only.
    Outcome: the save is refused at the call with one line ("read-only file system"); the previous checkpoint loads.
    """
    mnt = tmpfs("4m")
    root = mnt / "ckpts"
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(_small(1.0), root / "step_0")
    cp.wait()
    remount(mnt, "ro")
    try:
        with pytest.raises(ckpt.CheckpointError, match=r"is not writable \(read-only file system\)"):
            cp.async_save(_small(2.0), root / "step_1")
        assert cp.pending == 0
        assert _loaded(root) == 1.0
    finally:
        remount(mnt, "rw")
    _writer_gone(cp)


def test_checkpoint_dir_writable_by_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: a checkpoint directory that other users can write (loading unpickles DCP's .metadata).
    Outcome: nvrx creates checkpoint directories 0700 whatever the umask; loading from a group- or world-writable
    one is refused with one line saying how to fix it, unless NVRX_CKPT_ALLOW_SHARED_WRITABLE=1 (or the argument).
    """
    monkeypatch.delenv("NVRX_CKPT_ALLOW_SHARED_WRITABLE", raising=False)
    root = tmp_path / "ckpts"
    old = os.umask(0)
    try:
        cp = ckpt.AsyncCheckpointer()
        cp.async_save(_small(3.0), root / "step_0")
        cp.wait()
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "step_0").stat().st_mode) == 0o700
    assert _loaded(root) == 3.0
    for mode, who in ((0o770, "its group"), (0o707, "everyone")):
        os.chmod(root, mode)
        with pytest.raises(ckpt.CheckpointError) as err:
            _loaded(root)
        msg = str(err.value)
        assert f"is writable by {who}" in msg and "chmod go-w" in msg and "\n" not in msg
        with pytest.raises(ckpt.CheckpointError, match="writable by"):
            ckpt.load_metadata(root / "step_0")
    state = _small(-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.load_latest(root, state, allow_shared_writable=True) is not None
    assert float(state["x"][0]) == 3.0
    monkeypatch.setenv("NVRX_CKPT_ALLOW_SHARED_WRITABLE", "1")
    assert _loaded(root) == 3.0
    _writer_gone(cp)
