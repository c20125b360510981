"""``nvrx.ckpt.PeriodicCheckpointer``: one call per step saves every N steps; after a crash the job resumes from the
newest complete checkpoint (not from a save that was still in flight) and trains to the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nvrx import ckpt

HERE = Path(__file__).resolve().parent
STEPS, CRASH_AT = 30, 17


def _launch(launcher, out: Path, crash_at: int, restarts: int) -> None:
    done = launcher.run("--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts), "--async-ckpt",
                        str(HERE / "periodic_train.py"), str(out), str(STEPS), str(crash_at))
    assert done.returncode == 0, done.stderr[-3000:]


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_a_crashed_job_resumes_from_the_newest_complete_checkpoint(launcher, tmp_path: Path) -> None:
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    crashed.mkdir()
    clean.mkdir()
    _launch(launcher, crashed, CRASH_AT, restarts=1)
    newest = _read(crashed / "crash.json")["newest"]
    assert newest is not None, "no checkpoint was complete before the crash"
    steps_in_newest = int(newest.split("_")[1])
    assert 0 < steps_in_newest <= CRASH_AT + 1  # (+1: a save delayed by a slow publish starts at the next step)
    for rank in (0, 1):
        assert _read(crashed / f"start-a0-r{rank}.json")["start"] == 0
        # the save started right before the crash (step CRASH_AT + 2) never completed: not resumed from
        resumed = _read(crashed / f"start-a1-r{rank}.json")
        assert resumed["newest"] == newest  # the unfinished save never became a complete checkpoint
        assert resumed["start"] == steps_in_newest
        assert resumed["zero_steps"] == 0  # Adam's state was allocated from the checkpoint, not by a zero step
    left = sorted(p.name for p in (crashed / "ckpts").iterdir())
    assert not [n for n in left if n.endswith(".partial")], left  # the crashed save's partial was swept
    assert f"step_{STEPS:09d}" in left  # the last save was published by close()
    _launch(launcher, clean, -1, restarts=0)
    # model and Adam state came back exactly: the same weights as a run without the crash
    assert _read(crashed / "final.json") == _read(clean / "final.json")
    assert launcher.leftovers() == []


def test_saving_by_time_is_agreed_by_the_ranks(launcher, tmp_path: Path) -> None:
    """every_seconds: each rank's clock says "due" at its own moment; the ranks must still save together."""
    done = launcher.run("--standalone", "--nproc-per-node", "2", "--async-ckpt", str(HERE / "periodic_train.py"),
                        str(tmp_path), str(STEPS), "-1", "0.000001")
    assert done.returncode == 0, done.stderr[-3000:]  # a disagreement would deadlock or fail a collective
    saved = sorted(p.name for p in (tmp_path / "ckpts").iterdir() if p.name.startswith("step_"))
    assert saved and saved[-1] == f"step_{STEPS:09d}", saved  # saves happened, the last one by close()
    ckpt.verify_checkpoint(tmp_path / "ckpts" / saved[-1])
    assert launcher.leftovers() == []


def test_a_fresh_start_loads_nothing_and_leaves_the_optimizer_alone(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    saver = ckpt.PeriodicCheckpointer(tmp_path / "ckpts", model=model, optimizer=opt, every_steps=3)
    assert saver.resume() == 0
    assert not opt.state  # no zero step taken to build a state dict (Adam's step count stays exact)
    assert saver.last_saved is None


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "every_steps, every_seconds"),
    ({"every_steps": 0}, "every_steps must be >= 1"),
    ({"every_seconds": -1.0}, "every_seconds must be > 0"),
])
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ckpt.PeriodicCheckpointer(tmp_path, model=torch.nn.Linear(1, 1), **kwargs)


def test_an_optimizer_without_its_model_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="model="):
        ckpt.PeriodicCheckpointer(tmp_path, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), every_steps=1)
