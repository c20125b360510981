"""`nvrx inspect` shows a fault's just-in-time checkpoint, from real `nvrx launch --jit-ckpt` runs' events.

The same trainer and launch as tests/ckpt/test_jit.py (2 DDP ranks on gloo, rank 1 dies after its step 12), with
the run's event files in a log dir: the terminal view says the JIT outcome on the fault's stop line, ``--json``
has it on the fault, ``--html`` in the faults table, and the step it names is the one the restarted job resumed
at (what the trainer recorded).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.ckpt.test_jit import FAULT_AT, assert_fell_back, launch, starts
from tests.conftest import REPO


def inspect(*args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "nvrx", "inspect", *args], capture_output=True, text=True, cwd=REPO, check=False,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def jit_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "just-in-time checkpoint" in ln]


def fault_of(logs: Path) -> dict:
    """The run's one fault in the --json report (with its jit_checkpoint)."""
    report = json.loads(inspect("--json", str(logs)).stdout)
    (fault,) = report["faults"]
    assert report["jit_checkpoints"] == [fault["jit_checkpoint"]]
    return fault


def test_inspect_shows_the_saved_step_the_restart_resumed_from(launcher, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    res = launch(launcher, out, "crash", "--log-dir", str(logs))
    assert res.returncode == 0, res.stderr[-3000:]
    saved = FAULT_AT + 1
    assert starts(out, 1) == {saved}  # the restarted job resumed at the JIT checkpoint's step
    (line,) = jit_lines(inspect(str(logs)).stdout)  # on the fault's stop line
    assert "round 0 stopped: rank 1 was killed by SIGKILL" in line, line
    assert f"; just-in-time checkpoint of step {saved} saved in " in line, line
    assert line.endswith(" s by rank 0; resumed from it"), line
    fault = fault_of(logs)
    j = fault["jit_checkpoint"]
    assert fault["rank"] == 1 and j["fault"] == "failed" and j["lost"] == [1]
    assert (j["outcome"], j["step"], j["rank"], j["resume_step"], j["resume_from"]) == ("saved", saved, 0, saved, "jit")
    assert j["resumed"] and 0 < j["seconds"] <= j["waited_s"] and j["path"].endswith(f"/jit_step_{saved:09d}")
    (node,) = j["nodes"]
    assert node["answers"] == [{"local_rank": 0, "rank": 0, "outcome": "saved"}] and j["nodes_skipped"] == 0
    page = tmp_path / "report.html"
    inspect("--html", str(page), str(logs))
    assert f"just-in-time checkpoint of step {saved} saved in" in page.read_text()


def test_inspect_shows_why_sharded_state_fell_back_and_the_step_resumed_from(launcher, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    res = launch(launcher, out, "sharded", "--log-dir", str(logs))
    why = "sharded state (DTensor): the shards of lost rank(s) [1] have no other holder"
    assert_fell_back(launcher, res, out, why)
    previous = json.loads((out / "before.json").read_text())["steps"]
    assert 0 < previous < FAULT_AT + 1 and starts(out, 1) == {previous}
    (line,) = jit_lines(inspect(str(logs)).stdout)
    assert "round 0 stopped: rank 1 was killed by SIGKILL" in line, line
    assert line.endswith(f"; no just-in-time checkpoint of step {FAULT_AT + 1} ({why}); resumed from the "
                         f"newest periodic/local checkpoint, step {previous}"), line
    j = fault_of(logs)["jit_checkpoint"]
    assert (j["outcome"], j["reason"], j["resume_step"], j["resume_from"]) == ("failed", why, previous, "checkpoint")
    (node,) = j["nodes"]
    assert node["answers"] == [{"local_rank": 0, "rank": 0, "outcome": "failed", "reason": why}]
