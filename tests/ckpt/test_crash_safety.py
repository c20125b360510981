"""SIGKILL of the training process and of its writer process at random moments of a save (seeded trials):
the previous checkpoint always loads, no partial checkpoint is ever listed, and no writer is left behind."""

from __future__ import annotations

import os
import random
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
SEED = int(os.environ.get("NVRX_CKPT_CRASH_SEED", "20240611"))
TRAINER_KILLS = int(os.environ.get("NVRX_CKPT_TRAINER_KILLS", "5"))
WRITER_KILLS = int(os.environ.get("NVRX_CKPT_WRITER_KILLS", "15"))



def lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def check_root(root: Path) -> list[int]:
    """Every listed name is a complete checkpoint that verifies and holds one save's values; returns the steps."""
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p.name != "latest")
    complete = {c.path.name for c in ckpt.list_checkpoints(root)}
    assert set(names) == complete, f"listed but not complete: {set(names) - complete}"
    steps = []
    for name in names:
        ckpt.verify_checkpoint(root / name)
        state = {"a": torch.zeros(3 << 20), "b": torch.zeros(1 << 20), "meta": {"step": -1, "tag": ""}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(root / name))
        step = state["meta"]["step"]
        assert name == f"step_{step:05d}" and torch.all(state["a"] == step) and torch.all(state["b"] == step)
        steps.append(step)
    if names:
        assert (root / "latest").read_text().strip() in names
    return steps


class Trainer:
    def __init__(self, tmp_path: Path, token: str) -> None:
        self.root = tmp_path / "ckpts"
        self.status = tmp_path / f"status-{uuid.uuid4().hex[:6]}"
        self.stop = tmp_path / "stop"
        env = dict(os.environ, NVRX_TEST_TOKEN=token, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "crash_trainer.py"), str(self.root), str(self.status),
                                      str(self.stop)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def saved(self) -> int:
        return sum(1 for line in lines(self.status) if line.startswith("saved"))

    def writer_pid(self) -> int:
        pids = [int(line.split()[1]) for line in lines(self.status) if line.startswith("writer")]
        return pids[-1] if pids else 0


def test_sigkill_of_the_training_process_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    token = uuid.uuid4().hex
    try:
        for trial in range(TRAINER_KILLS):
            trainer = Trainer(tmp_path, token)
            assert wait_for(lambda: trainer.saved() >= 1 or trainer.proc.poll() is not None, 90), "no first save"
            assert trainer.proc.poll() is None, trainer.proc.stderr.read().decode()[-2000:]
            time.sleep(rng.uniform(0.0, 1.0))  # somewhere in staging, writing, publishing or pruning
            writer = trainer.writer_pid()
            trainer.proc.send_signal(signal.SIGKILL)
            trainer.proc.wait()
            assert wait_for(lambda: pid_gone(writer), 10), f"writer {writer} outlived its trainer (trial {trial})"
            steps = check_root(trainer.root)
            assert steps, "the previous checkpoint must survive"
            info = ckpt.find_latest_checkpoint(trainer.root)
            assert info is not None and info.path.name == f"step_{max(steps):05d}"
        assert tagged_processes(token) == []
    finally:
        for p in tagged_processes(token):
            p.kill()


def test_sigkill_of_the_writer_process_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(SEED + 1)
    token = uuid.uuid4().hex
    trainer = Trainer(tmp_path, token)
    try:
        assert wait_for(lambda: trainer.saved() >= 1 or trainer.proc.poll() is not None, 90), "no first save"
        killed = set()
        for _ in range(WRITER_KILLS):
            time.sleep(rng.uniform(0.0, 0.5))
            pid = trainer.writer_pid()
            if pid in killed:  # the trainer has not started a new writer yet (no save since the last kill)
                assert wait_for(lambda: trainer.writer_pid() not in killed, 60), "no new writer"
                pid = trainer.writer_pid()
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
            assert trainer.proc.poll() is None, trainer.proc.stderr.read().decode()[-2000:]
        saved_before = trainer.saved()
        # it recovers by itself
        assert wait_for(lambda: trainer.saved() > saved_before, 60), "no save after the last kill"
        trainer.stop.touch()
        assert trainer.proc.wait(60) == 0, trainer.proc.stderr.read().decode()[-2000:]
        failures = [line for line in lines(trainer.status) if line.startswith("failed")]
        assert failures, "no kill hit a save in flight: the failure path was not exercised"
        assert all("writer process" in line and "SIGKILL" in line and "previous checkpoint is intact" in line
                   for line in failures), failures[:3]
        check_root(trainer.root)
        assert lines(trainer.status)[-1] == "stopped"
        assert wait_for(lambda: tagged_processes(token) == [], 10), "processes left behind"
    finally:
        if trainer.proc.poll() is None:
            trainer.proc.kill()
        for p in tagged_processes(token):
            p.kill()
