"""Storage faults on real small file systems: a full disk and a read-only mount give a clear error in the
training process, leave the previous checkpoint intact, and (by choice) are retried or skipped."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nvrx import ckpt
from tests.ckpt.conftest import remount


def visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def assert_intact(root: Path, name: str, value: float) -> None:
    ckpt.verify_checkpoint(root / name)
    assert (root / "latest").read_text().strip() == name
    state = {"x": torch.zeros(50_000)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(root / name))
    assert torch.all(state["x"] == value)


def small(value: float) -> dict:
    return {"x": torch.full((50_000,), value)}  # 200 kB


def big() -> dict:
    return {"x": torch.ones(1_000_000)}  # 4 MB: does not fit in 2 MB


def test_disk_full_is_a_clear_error_and_the_previous_checkpoint_survives(tmpfs) -> None:
    root = tmpfs("2m") / "ckpts"
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(small(1.0), root / "step_0")
    cp.wait()
    cp.async_save(big(), root / "step_1")  # staging succeeds; the writer process hits ENOSPC
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        cp.wait()
    message = str(err.value)
    assert "step_1 was not saved" in message and "No space left on device" in message and "\n" not in message
    assert cp.pending == 0
    assert visible(root) == ["latest", "step_0"] and hidden(root) == []  # the half-written one was removed
    assert_intact(root, "step_0", 1.0)
    cp.async_save(small(2.0), root / "step_2")  # space is back: saving works again
    cp.wait()
    assert_intact(root, "step_2", 2.0)

    with pytest.raises(ckpt.CheckpointWriteError, match="No space left on device"):
        cp.async_torch_save({"x": torch.ones(1_000_000)}, root / "extra.pt")
        cp.wait()
    assert visible(root) == ["latest", "step_0", "step_2"] and hidden(root) == []


def test_failed_write_can_be_skipped_or_retried(tmpfs, caplog: pytest.LogCaptureFixture) -> None:
    root = tmpfs("2m") / "ckpts"
    caplog.set_level(logging.WARNING, logger="nvrx.ckpt")
    skipping = ckpt.AsyncCheckpointer(skip_failed=True)
    skipping.async_save(small(1.0), root / "step_0")
    skipping.wait()
    skipping.async_save(big(), root / "step_1")
    assert skipping.wait() == []  # no exception: training goes on
    assert "step_1 was not saved" in caplog.text and "skipped; training continues" in caplog.text
    assert_intact(root, "step_0", 1.0)

    caplog.clear()
    retrying = ckpt.AsyncCheckpointer(retries=2)
    retrying.async_save(big(), root / "step_2")
    with pytest.raises(ckpt.CheckpointWriteError, match="No space left on device"):
        retrying.wait()
    assert "trying again (1 of 2)" in caplog.text and "trying again (2 of 2)" in caplog.text
    assert_intact(root, "step_0", 1.0)
    assert visible(root) == ["latest", "step_0"] and hidden(root) == []


def test_read_only_mount_is_refused_at_the_call(tmpfs) -> None:
    mnt = tmpfs("4m")
    root = mnt / "ckpts"
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(small(1.0), root / "step_0")
    cp.wait()
    remount(mnt, "ro")
    try:
        with pytest.raises(ckpt.CheckpointError, match=r"is not writable \(read-only file system\)"):
            cp.async_save(small(2.0), root / "step_1")
        with pytest.raises(ckpt.CheckpointError, match=r"cannot create .*/ckpts/new \(Read-only file system\)"):
            cp.async_save(small(2.0), root / "new" / "step_1")  # a checkpoint root that does not exist yet
        with pytest.raises(ckpt.CheckpointError, match="read-only file system"):
            cp.async_torch_save({"a": 1}, root / "extra.pt")
        assert cp.pending == 0
        assert_intact(root, "step_0", 1.0)
    finally:
        remount(mnt, "rw")
    assert visible(root) == ["latest", "step_0"] and hidden(root) == []


def test_checkpoint_root_under_a_missing_mount_is_refused(tmp_path: Path) -> None:
    """A root whose parent is missing (file system not mounted) must not be created on the local disk."""
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(small(1.0), tmp_path / "ckpts" / "step_0")  # the root itself is created: its parent exists
    cp.wait()
    mountpoint = tmp_path / "scratch"  # where a file system should be mounted, but is not
    for save in (lambda: cp.async_save(small(2.0), mountpoint / "run1" / "ckpts" / "step_1"),
                 lambda: cp.async_torch_save({"a": 1}, mountpoint / "run1" / "ckpts" / "extra.pt")):
        with pytest.raises(ckpt.CheckpointError) as err:
            save()
        message = str(err.value)
        assert f"{mountpoint / 'run1'} does not exist (is its file system mounted?)" in message, message
        assert "\n" not in message and "mount the file system or create" in message
    assert not mountpoint.exists()  # nothing was created on the wrong disk
    assert cp.pending == 0
    assert_intact(tmp_path / "ckpts", "step_0", 1.0)
