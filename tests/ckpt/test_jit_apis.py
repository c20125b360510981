"""Just-in-time checkpoints through ``ckpt.save_on_failure`` and ``TwoTierCheckpointer(save_on_failure=True)``,
under real `nvrx launch --jit-ckpt`, 2 DDP ranks on gloo (tests/ckpt/jit_apis_train.py).

Rank 1 dies right after its optimizer step of iteration 13 (no periodic save then: the module API saves every 5,
the two tiers every 2 locally and every 5 globally). A working JIT save makes the restart start at 13 done and
train to the same parameters as a run without a fault; a JIT save that a second failure cuts short leaves no
JIT checkpoint and the restart uses the newest periodic / local one. Nothing unfinished is left, no process either.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ckpt.test_jit import agent_lines, check_clean

HERE = Path(__file__).resolve().parent
FAULT_AT, STEPS = 13, 20


def launch(launcher, out: Path, api: str, fault: str, timeout: float = 180):
    out.mkdir(parents=True, exist_ok=True)
    return launcher.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--async-ckpt", "--jit-ckpt",
                        "--local-ckpt-dir", str(out / "local"), str(HERE / "jit_apis_train.py"), str(out), api,
                        str(STEPS), fault, str(FAULT_AT), timeout=timeout)


def started(out: Path, attempt: int) -> list[dict]:
    return [json.loads((out / f"start-a{attempt}-r{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("api,name", [("module", "jit_step_000000013"), ("twotier", "jit_iter_000000013")])
def test_a_crash_resumes_from_the_survivors_last_completed_step(launcher, tmp_path, api, name):
    res = launch(launcher, tmp_path / "jit", api, "crash")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = agent_lines(res.stderr, "just-in-time checkpoint of step")
    assert f"step {FAULT_AT} saved" in line and name in line, line
    starts = started(tmp_path / "jit", 1)
    assert {s["start"] for s in starts} == {FAULT_AT}, starts  # not the newest periodic / local save (10 / 12)
    if api == "twotier":
        assert {s["tier"] for s in starts} == {"global"} and all("just-in-time" in s["why"] for s in starts), starts
    check_clean(launcher, tmp_path / "jit" / "ckpts")
    clean = launch(launcher, tmp_path / "clean", api, "none")
    assert clean.returncode == 0, clean.stderr[-3000:]
    final = json.loads((tmp_path / "jit" / "final.json").read_text())
    assert final == json.loads((tmp_path / "clean" / "final.json").read_text())  # exactly the state of step 13


@pytest.mark.parametrize("api", ["module", "twotier"])
def test_a_second_failure_during_the_jit_save_falls_back(launcher, tmp_path, api):
    res = launch(launcher, tmp_path, api, "second")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = agent_lines(res.stderr, "no just-in-time checkpoint")
    assert "went away during the save" in line and "newest periodic/local checkpoint" in line, line
    root = tmp_path / "ckpts"
    assert not any(p.name.startswith("jit_") for p in root.iterdir())
    starts = started(tmp_path, 1)
    assert len({s["start"] for s in starts}) == 1 and 0 < starts[0]["start"] < FAULT_AT, starts
    if api == "module":
        assert starts[0]["why"] == "step_000000010"  # the newest periodic save before the fault
    else:  # the local tier's iteration 12 if it was complete on both ranks, else the global tier's 10
        assert (starts[0]["tier"], starts[0]["start"]) in (("local", 12), ("global", 10)), starts
    assert json.loads((tmp_path / "final.json").read_text())["params"]
    check_clean(launcher, root)
