"""The template's warm-up is cut into steps (nvrx/launcher/agent/fork_server.py WARM_UP_STEPS) by importing, before
torch._dynamo, modules its import would load anyway. This holds only if those imports load exactly what building an
optimizer loads, and if none of them fails on the installed torch (a failing step ends the warm-up early)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r'''
import json, sys
import torch, torch.distributed
from nvrx.launcher.agent import fork_server as fs
if sys.argv[1] == "steps":
    warm = fs.WarmUp(fs.WARM_UP_STEPS)
    warm.run_all()
    failed = warm.failed
else:  # one optimizer, then the steps after it: what the warm-up did in one piece before it had steps
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    for name in fs.WARM_UP_STEPS[fs.WARM_UP_STEPS.index(fs._build_throwaway_optimizer) + 1:]:
        fs._import_optional(name)
    failed = None
print(json.dumps({"modules": sorted(sys.modules), "failed": failed}))
'''


def _modules_after(way: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, way], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.integration  # starts a process / opens a socket
def test_the_steps_load_what_one_optimizer_loads_and_none_fails() -> None:
    steps, whole = _modules_after("steps"), _modules_after("whole")
    assert steps["failed"] is None
    assert set(steps["modules"]) == set(whole["modules"])
    assert "torch._dynamo" in steps["modules"]


PRECOMPILED = r'''
import sys
from nvrx.launcher.rank import bootstrap
script = sys.argv[1]
bootstrap.precompile(script, False)
expected = bootstrap._COMPILED[bootstrap.os.path.abspath(script)][1]
if sys.argv[2] == "edit":
    with open(script, "a") as fh:
        fh.write("print('edited')\n")
sys.modules["__precompiled__"] = expected
bootstrap._run_script(script, [])
'''


def _run_precompiled(tmp_path, how: str) -> list[str]:
    script = tmp_path / "user.py"
    script.write_text("import sys\nprint(sys._getframe().f_code is sys.modules['__precompiled__'], __name__, sys.argv)\n")
    done = subprocess.run([sys.executable, "-c", PRECOMPILED, str(script), how], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.integration  # starts a process / opens a socket
def test_a_rank_runs_the_script_compiled_by_the_template(tmp_path) -> None:
    assert _run_precompiled(tmp_path, "same") == [f"True __main__ ['{tmp_path / 'user.py'}']"]


@pytest.mark.integration  # starts a process / opens a socket
def test_a_script_edited_since_is_compiled_again(tmp_path) -> None:
    assert _run_precompiled(tmp_path, "edit") == [f"False __main__ ['{tmp_path / 'user.py'}']", "edited"]


def test_a_script_that_warns_when_compiled_is_left_to_the_rank(tmp_path) -> None:
    """Its compile-time warnings must show in the rank, as `python script.py` shows them, not in the template."""
    from nvrx.launcher.rank import bootstrap

    script = tmp_path / "warns.py"
    script.write_text("x = 'a \\d'\nassert (x, 'never empty')\n")  # an invalid escape and an always-true assert
    bootstrap.precompile(str(script), False)
    assert str(script) not in bootstrap._COMPILED
    quiet = tmp_path / "quiet.py"
    quiet.write_text("x = 1\n")
    bootstrap.precompile(str(quiet), False)
    assert bootstrap._COMPILED.pop(str(quiet))[0] == b"x = 1\n"


def test_a_circular_import_ends_the_warm_up(tmp_path, monkeypatch) -> None:
    """Not skipped like a missing module: later steps would build on a half-imported package."""
    from nvrx.launcher.agent import fork_server

    (tmp_path / "nvrx_circ_a.py").write_text("from nvrx_circ_b import B\nA = 1\n")
    (tmp_path / "nvrx_circ_b.py").write_text("from nvrx_circ_a import A\nB = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = fork_server.WarmUp(["nvrx_circ_a", "json"])
    steps.step()
    assert steps.done and steps.failed == "nvrx_circ_a"
