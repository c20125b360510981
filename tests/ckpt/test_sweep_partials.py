"""Unfinished checkpoints (``.NAME.partial``) left by crashed saves are swept on resume and on the first save
into a directory - only names this package produces, and only when their writer is gone or they went idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from nvrx import ckpt
from nvrx.ckpt import publish
from tests.ckpt.conftest import child_env

HOUR = 3600.0


def crash_mid_save(root: Path, name: str) -> None:
    """A real training process that starts a save of NAME and is SIGKILLed before it is finalized."""
    code = textwrap.dedent(f"""
        import os, signal, torch
        from nvrx import ckpt
        cp = ckpt.AsyncCheckpointer()
        cp.async_save({{"x": torch.full((1 << 20,), 2.0)}}, {str(root / name)!r})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr


def plant(root: Path, name: str, *, age: float = 0.0, owner: dict | None = None, is_dir: bool = True) -> Path:
    path = root / name
    if is_dir:
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"half")
        if owner is not None:
            (path / publish.OWNER_FILE).write_text(json.dumps(owner))
    else:
        path.write_bytes(b"half")
    then = time.time() - age
    for p in [*(path.iterdir() if is_dir else []), path]:
        os.utime(p, (then, then))
    return path


def dead_owner() -> dict:
    """The owner record of a process of this machine that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = publish.owner_record(proc.pid)
    record["start"] = record["start"] or 1
    proc.wait()
    return record


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_resume_sweeps_the_partial_of_a_crashed_save_and_planted_stale_ones(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    cp = ckpt.AsyncCheckpointer()
    cp.async_save({"x": torch.full((1 << 20,), 1.0)}, root / "step_0")
    cp.wait()
    crash_mid_save(root, "step_1")
    assert ".step_1.partial" in hidden(root)  # what the crash left

    me = publish.owner_record(os.getpid())
    elsewhere = {"boot_id": "another-node", "pid": 1, "start": 1}
    plant(root, ".step_2.partial", age=2 * HOUR)                       # no record, idle for long: stale
    plant(root, ".step_3.partial")                                      # no record, just written: maybe in use
    plant(root, ".step_4.partial", age=2 * HOUR, owner=me)              # its writer runs (this process): in use
    plant(root, ".step_5.partial", owner=elsewhere)                     # another node, active: in use
    plant(root, ".step_6.partial", age=2 * HOUR, owner=elsewhere)       # another node, idle for long: stale
    plant(root, ".extra.pt.partial", age=2 * HOUR, is_dir=False)        # a torch.save-style file, idle: stale
    plant(root, ".notes.tmp", age=2 * HOUR, is_dir=False)               # not a name this package writes
    plant(root, "draft.partial", age=2 * HOUR)                          # not hidden: not ours either

    state = {"x": torch.zeros(1 << 20)}
    info = ckpt.AsyncCheckpointer().resume(root, state)
    assert info is not None and info.path.name == "step_0" and torch.all(state["x"] == 1.0)
    assert hidden(root) == [".notes.tmp", ".step_3.partial", ".step_4.partial", ".step_5.partial"]
    assert (root / "draft.partial").is_dir()
    assert [c.path.name for c in ckpt.list_checkpoints(root)] == ["step_0"]


def test_first_save_into_a_directory_sweeps_dead_writers_partials(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    plant(root, ".step_1.partial", owner=dead_owner())  # fresh, but its writer is gone: stale at once
    plant(root, ".step_2.partial")
    cp = ckpt.AsyncCheckpointer()
    cp.async_save({"x": torch.ones(8)}, root / "step_3")
    cp.wait()
    assert hidden(root) == [".step_2.partial"]
    plant(root, ".step_4.partial", owner=dead_owner())  # later saves of this checkpointer do not list the root again
    cp.async_save({"x": torch.ones(8)}, root / "step_5")
    cp.wait()
    assert hidden(root) == [".step_2.partial", ".step_4.partial"]
    assert ckpt.AsyncCheckpointer(stale_partial_seconds=None).sweep(root) == []  # sweeping can be turned off
    assert ckpt.AsyncCheckpointer().sweep(root) == [".step_4.partial"]
