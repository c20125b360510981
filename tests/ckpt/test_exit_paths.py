"""How a training process ends with saves in flight: a SIGTERM graceful stop publishes the agreed step's
checkpoint before exit; a normal end or a crash without finalize leaves no writer process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from nvrx import ckpt
from tests.conftest import pid_gone, tagged_processes, wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def start(root: Path, mode: str, token: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(NVRX_TEST_TOKEN=token, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, str(HERE / "exit_trainer.py"), str(root), mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def read_until(proc: subprocess.Popen, prefix: str, timeout: float = 60.0) -> str:
    """Read PROC's stdout up to the first line starting with PREFIX; fail once it ended or TIMEOUT passed."""
    deadline = time.monotonic() + timeout
    seen = []
    for line in iter(proc.stdout.readline, ""):  # the trainer prints a line every 20 steps, so this returns
        if line.startswith(prefix):
            return line
        seen.append(line)
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no {prefix!r} line from the trainer; got {seen}")


def writer_gone(pid: int) -> bool:
    return wait_for(lambda: pid_gone(pid), 10.0)


def test_graceful_stop_publishes_the_agreed_step_before_exit(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    root = tmp_path / "ckpts"
    proc = start(root, "graceful", token)
    try:
        first = proc.stdout.readline()
        assert first.startswith("writer "), proc.stderr.read()
        writer = int(first.split()[1])
        read_until(proc, "saving ")  # a periodic save is in flight when the stop arrives
        os.killpg(proc.pid, signal.SIGTERM)  # as the launcher does: the whole process group, writer included
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    stop_step = int(out.split("stopped")[1].split()[0])
    name = f"step_{stop_step:06d}"
    assert (root / "latest").read_text().strip() == name
    ckpt.verify_checkpoint(root / name)
    state = {"x": torch.zeros(1 << 18), "meta": {"step": -1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(root / name))
    assert state["meta"]["step"] == stop_step and torch.all(state["x"] == stop_step)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # nothing left half-written
    assert writer_gone(writer) and tagged_processes(token) == []


def test_no_writer_is_left_behind_when_training_ends_without_finalize(tmp_path: Path) -> None:
    for mode, code in (("return", 0), ("raise", 1)):
        token = uuid.uuid4().hex
        root = tmp_path / mode
        proc = start(root, mode, token)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        writer = int(out.split()[1])
        assert writer_gone(writer), f"{mode}: writer {writer} outlived its trainer"
        assert "never finalized and are not published" in err
        assert ckpt.list_checkpoints(root) == []  # an unfinalized save is never listed
        assert tagged_processes(token) == []
